"""aiacc.keras: the same module object as :mod:`aiacc.tensorflow.keras` (Keras 3 on TensorFlow).

``import aiacc.keras as hvd`` and ``import aiacc.tensorflow.keras as hvd`` give one module, so the
classes (``hvd.DistributedOptimizer``, ``hvd.callbacks.*``) are identical whichever name is used.
"""

import sys

from aiacc.tensorflow import keras as _keras
from aiacc.tensorflow.keras import callbacks as _callbacks
from aiacc.tensorflow.keras import elastic as _elastic

sys.modules[__name__] = _keras
sys.modules[__name__ + ".callbacks"] = _callbacks
sys.modules[__name__ + ".elastic"] = _elastic
