"""aiacc.keras: the same module object as :mod:`aiacc.tensorflow.keras` (Keras 3 on its TensorFlow, PyTorch or
JAX backend; TensorFlow must be installed for each).

``import aiacc.keras as hvd`` and ``import aiacc.tensorflow.keras as hvd`` give one module, so the
classes (``hvd.DistributedOptimizer``, ``hvd.callbacks.*``) are identical whichever name is used.
"""

import sys

try:
    import tensorflow  # noqa: F401
except ModuleNotFoundError as exc:  # (Keras on PyTorch/JAX without TensorFlow: say what is needed, not only "no module")
    raise ModuleNotFoundError("aiacc.keras needs TensorFlow installed (pip install 'aiacc[tensorflow]'), also for "
                              "Keras on the PyTorch or JAX backend: its callbacks and collectives are aiacc.tensorflow's; "
                              "or train a torch model with aiacc.torch", name="tensorflow") from exc

from aiacc.tensorflow import keras as _keras  # noqa: E402
from aiacc.tensorflow.keras import callbacks as _callbacks  # noqa: E402
from aiacc.tensorflow.keras import elastic as _elastic  # noqa: E402

sys.modules[__name__] = _keras
sys.modules[__name__ + ".callbacks"] = _callbacks
sys.modules[__name__ + ".elastic"] = _elastic
