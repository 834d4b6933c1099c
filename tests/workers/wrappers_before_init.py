"""The gradient wrappers of the three adapters made before init(): switched off (AIACC_ENABLE unset) each
hands back the framework's own object; switched on, each raises NotInitializedError naming itself. One
plain process ("on" as argv[1]: AIACC_ENABLE=1 is set by the test, nothing is initialised)."""

import sys

import aiacc.mxnet as hvd_mx  # first: it restores numpy.bool, which MXNet 1.9.1 needs
import aiacc.tensorflow as hvd_tf
import aiacc.tensorflow.keras as hvd_keras
import aiacc.torch as hvd_torch
import keras
import mxnet as mx
import tensorflow as tf
import torch

import aiacc
from report import raises, say

on = sys.argv[1:] == ["on"]
assert aiacc.is_enabled() == on and not aiacc.is_initialized()
model = torch.nn.Linear(2, 1)
dense = mx.gluon.nn.Dense(1, in_units=2)
dense.initialize()
params = dense.collect_params()
torch_opt = torch.optim.SGD(model.parameters(), lr=0.1)
tape = tf.GradientTape()
keras_opt = keras.optimizers.SGD(0.1)
mx_opt = mx.optimizer.SGD(learning_rate=0.1)
cases = [  # (the wrapper's name in errors, make it, the framework's own object it hands back)
    ("DistributedOptimizer", lambda: hvd_torch.DistributedOptimizer(torch_opt, model.named_parameters()), torch_opt),
    ("DistributedGradientTape", lambda: hvd_tf.DistributedGradientTape(tape), tape),
    ("DistributedOptimizer", lambda: hvd_keras.DistributedOptimizer(keras_opt), keras_opt),
    ("DistributedOptimizer", lambda: hvd_mx.DistributedOptimizer(mx_opt), mx_opt),
    ("DistributedTrainer", lambda: hvd_mx.DistributedTrainer(params, "sgd"), None),
]
checks = 0
for what, make, own in cases:
    if on:
        raises(aiacc.NotInitializedError, make, f"{what} was created before init(); call init() first")
    else:
        made = make()
        assert made is own if own is not None else type(made) is hvd_mx.DistributedTrainer, (what, made)
    checks += 1
say(f"OK rank=0 checks={checks}")
