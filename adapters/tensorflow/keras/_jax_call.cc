// aiacc.keras on JAX: the XLA FFI handler through which a compiled train step calls aiacc's Python (its gradient
// reduction, its checks) on the CPU. jax.experimental.io_callback does the same, but a compiled function that holds
// one is dispatched by JAX's Python path, ~28 us per argument and result array every step (a Keras step passes every
// variable in and out); a custom call keeps JAX's C++ dispatch. See _jax_call.py.
#include <Python.h>

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static PyObject* g_dispatch = nullptr;  // _jax_call._dispatch(id, inputs, outputs)

extern "C" void aiacc_set_dispatch(PyObject* fn) {
  Py_XINCREF(fn);
  Py_XSETREF(g_dispatch, fn);
}

static PyObject* Pair(void* data, size_t bytes) {
  return Py_BuildValue("(Kn)", static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(data)),
                       static_cast<Py_ssize_t>(bytes));
}

static ffi::Error Call(int64_t id, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  PyGILState_STATE gil = PyGILState_Ensure();
  std::string message;
  PyObject* ins = PyList_New(args.size());
  PyObject* outs = PyList_New(rets.size());
  bool ok = ins != nullptr && outs != nullptr;
  for (size_t i = 0; ok && i < args.size(); ++i) {
    auto buffer = args.get<ffi::AnyBuffer>(i);
    if (buffer.has_error()) { ok = false; message = "aiacc: an argument of the host call is not a buffer"; break; }
    PyList_SET_ITEM(ins, i, Pair(buffer->untyped_data(), buffer->size_bytes()));
  }
  for (size_t i = 0; ok && i < rets.size(); ++i) {
    auto buffer = rets.get<ffi::AnyBuffer>(i);
    if (buffer.has_error()) { ok = false; message = "aiacc: a result of the host call is not a buffer"; break; }
    PyList_SET_ITEM(outs, i, Pair((*buffer)->untyped_data(), (*buffer)->size_bytes()));
  }
  PyObject* result = nullptr;
  if (ok && g_dispatch != nullptr) {
    result = PyObject_CallFunction(g_dispatch, "LOO", static_cast<long long>(id), ins, outs);
  } else if (ok) {
    message = "aiacc: the host call has no dispatcher";
  }
  Py_XDECREF(ins);
  Py_XDECREF(outs);
  if (result != nullptr) {
    Py_DECREF(result);
  } else if (PyErr_Occurred()) {  // the exception's type and message: what a user reads in JAX's error
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    PyObject* name = type ? PyObject_GetAttrString(type, "__name__") : nullptr;
    PyObject* text = value ? PyObject_Str(value) : nullptr;
    const char* n = name ? PyUnicode_AsUTF8(name) : nullptr;
    const char* t = text ? PyUnicode_AsUTF8(text) : nullptr;
    message = std::string(n ? n : "Exception") + ": " + (t ? t : "");
    Py_XDECREF(name);
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    PyErr_Clear();
  }
  PyGILState_Release(gil);
  if (!message.empty()) return ffi::Error(ffi::ErrorCode::kInternal, message);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(AiaccHostCall, Call,
                              ffi::Ffi::Bind().Attr<int64_t>("id").RemainingArgs().RemainingRets());
