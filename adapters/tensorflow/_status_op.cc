// AiaccStatus: fails with a given TensorFlow error code and message, or does nothing when the code is 0.
//
// Why it exists: inside a graph, aiacc's collectives run in Python (numpy_function), and TensorFlow turns a
// Python exception there into InvalidArgumentError, UnimplementedError or UnknownError by its class alone.
// Horovod's ops fail with the code of their status (FailedPreconditionError for a mismatch across ranks),
// and scripts catch those classes. The collective's Python side returns (code, message) instead of
// raising; this op, between it and the collective's outputs, turns them into that status. Built on first
// use by aiacc/tensorflow/_native.py (see there); without it aiacc falls back to raising in Python.
#include <string>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;

REGISTER_OP("AiaccStatus")
    .Input("code: int32")
    .Input("message: string")
    .SetIsStateful()  // never pruned, folded or merged with another
    .SetShapeFn(tensorflow::shape_inference::NoOutputs);

class AiaccStatusOp : public OpKernel {
 public:
  explicit AiaccStatusOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const int code = context->input(0).scalar<tensorflow::int32>()();
    if (code == 0) return;
    const std::string message(context->input(1).scalar<tensorflow::tstring>()());
    context->SetStatus(absl::Status(static_cast<absl::StatusCode>(code), message));
  }
};

REGISTER_KERNEL_BUILDER(Name("AiaccStatus").Device(tensorflow::DEVICE_CPU), AiaccStatusOp);

}  // namespace
