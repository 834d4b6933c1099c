"""Import every core module with torch, tensorflow, keras and mxnet made unimportable."""

import importlib
import importlib.abc
import pkgutil
import sys

BLOCKED = ("torch", "tensorflow", "keras", "mxnet", "jax", "cupy")


class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:  # (as pip's absence of the package would)
            raise ModuleNotFoundError(f"No module named {name!r} (blocked in this test)", name=name)
        return None


sys.meta_path.insert(0, Blocker())
for mod in BLOCKED:
    sys.modules.pop(mod, None)

import aiacc  # noqa: E402
from report import say  # noqa: E402

names = ["aiacc"]
for info in pkgutil.walk_packages(aiacc.__path__, "aiacc."):
    if info.name.split(".")[1] in ("torch", "tensorflow", "keras", "mxnet"):
        continue  # adapters: they exist to import their framework
    names.append(info.name)
for name in names:
    if name.endswith("__main__"):
        continue
    importlib.import_module(name)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not loaded, f"framework modules were imported: {loaded}"
try:  # Keras' adapter without TensorFlow (say, Keras on PyTorch): what to install, not only "no module"
    importlib.import_module("aiacc.keras")
except ModuleNotFoundError as exc:
    assert "aiacc.keras needs TensorFlow installed (pip install 'aiacc[tensorflow]')" in str(exc), exc
else:
    raise AssertionError("aiacc.keras imported without TensorFlow")
aiacc.init()
import numpy as np  # noqa: E402

assert np.array_equal(aiacc.allreduce(np.ones(3), op=aiacc.Sum), np.ones(3) * aiacc.size())
say(f"OK rank={aiacc.rank()} modules={len(names)}")
