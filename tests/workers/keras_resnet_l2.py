"""Keras' ResNet50 (weights=None, 32x32) with L2 kernel regularizers, as Horovod's ImageNet example builds it,
trained by model.fit with DistributedOptimizer: TensorFlow refused the step ("1696 nodes in a cycle": the
ordering edges of aiacc's submits met oneDNN's fusion of a layer's filter and bias gradients). On one rank the
average is the gradient itself, so two steps equal plain Keras' from the same weights."""

import copy

import numpy as np
import keras

import aiacc.keras as hvd
from report import say

hvd.init()
keras.utils.set_random_seed(0)
model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
config = model.get_config()
for layer, layer_config in zip(model.layers, config["layers"]):
    if hasattr(layer, "kernel_regularizer"):
        l2 = keras.regularizers.l2(5e-5)
        layer_config["config"]["kernel_regularizer"] = {"class_name": type(l2).__name__, "config": l2.get_config()}
rng = np.random.RandomState(0)
x, y = rng.rand(4, 32, 32, 3).astype("float32"), keras.utils.to_categorical(rng.randint(0, 10, 4), 10)
trained = []
for wrap in (hvd.DistributedOptimizer, lambda opt: opt):
    keras.utils.set_random_seed(1)  # (the same initial weights for both)
    model = keras.models.Model.from_config(copy.deepcopy(config))  # (from_config consumes its argument)
    start = model.get_weights()
    model.compile(loss="categorical_crossentropy", optimizer=wrap(keras.optimizers.SGD(0.01, momentum=0.9)))
    model.fit(x, y, batch_size=2, epochs=1, verbose=0, shuffle=False)
    trained.append(model.get_weights())
    moved = max(float(np.abs(a - b).max()) for a, b in zip(trained[-1], start))
    assert moved > 1e-4, moved
worst = max(float(np.abs(a - b).max()) for a, b in zip(*trained))
assert worst < 1e-5, f"DistributedOptimizer on one rank is {worst:.3g} from plain Keras"
say(f"OK rank={hvd.rank()} checks=2")
