"""Keras' mixed_float16 policy with aiacc.keras (any backend: KERAS_BACKEND), 2 or more ranks.

``compile`` wraps the DistributedOptimizer in a LossScaleOptimizer by itself. A batch whose float16 activations
overflow on rank 1 only must make every rank skip that step and halve the loss scale (no rank left waiting in the
reduction of the others); the steps around it train as plain Keras does on the whole batches (a reference on one
process, whose whole batch overflows at the same step). With ``backward_passes_per_step=2`` the skipped micro-batch
is skipped everywhere and the others accumulate as Keras' own ``gradient_accumulation_steps`` does; the optimizer's
variables never include the model's.
"""

import os

import numpy as np

if os.environ.get("KERAS_BACKEND") == "torch":
    import torch

    torch.set_num_threads(1)

import keras  # noqa: E402

import aiacc.keras as hvd  # noqa: E402
from report import say  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
keras.mixed_precision.set_global_policy("mixed_float16")
checks = 0

BATCH = 8  # per rank: each global batch of 8 * n rows is split in n shares, one per rank
rng = np.random.default_rng(3)
# small values: float16 gradients of a rank's share, scaled by 2^15, stay finite (but for the one below)
features = (0.5 * rng.normal(size=(5 * BATCH * n, 4))).astype(np.float32)  # 5 global batches
targets = (0.1 * rng.normal(size=(5 * BATCH * n, 1))).astype(np.float32)
features[BATCH * n + BATCH + 2, 0] = 1e6  # beyond float16 (inf): the second global batch overflows, in rank 1's share only
mine = np.concatenate([np.arange(BATCH * (n * b + r), BATCH * (n * b + r + 1)) for b in range(5)])


def model_of(optimizer):
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                              keras.layers.Dense(1, dtype="float32")])
    model.compile(optimizer=optimizer, loss="mse")
    return model


def weights(model):
    return [keras.ops.convert_to_numpy(w).astype(np.float32) for w in model.trainable_weights]


def reference(**kwargs):
    model = model_of(keras.optimizers.SGD(0.05, **kwargs))
    model.fit(features, targets, batch_size=n * BATCH, epochs=1, shuffle=False, verbose=0)
    scale = float(keras.ops.convert_to_numpy(model.optimizer.dynamic_scale))
    assert scale == 2.0 ** 14, scale  # halved once from 2^15: the reference skipped one step
    return model, scale


# what compile makes (LossScaleOptimizer around DistributedOptimizer), and the other order, given by hand; then
# with gradient accumulation (the finite check runs on every micro-batch, the reduction on every second)
ref, ref_scale = reference()
ref_acc, _ = reference(gradient_accumulation_steps=2)
for what, optimizer, ref in [
        ("compile's LossScaleOptimizer", hvd.DistributedOptimizer(keras.optimizers.SGD(0.05), name="scaled"), ref),
        ("DistributedOptimizer(LossScaleOptimizer)",
         hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05)), name="outer"), ref),
        ("backward_passes_per_step=2", hvd.DistributedOptimizer(
            keras.optimizers.SGD(0.05), name="accumulated", backward_passes_per_step=2,
            average_aggregated_gradients=True), ref_acc)]:
    model = model_of(optimizer)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer), (what, type(model.optimizer))
    start = weights(model)
    model.fit(features[mine], targets[mine], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    mixed_in = [v.path for v in model.optimizer.variables if any(v is w for w in model.trainable_weights)]
    assert not mixed_in, (what, "the model's variables among the optimizer's", mixed_in)
    scale = float(keras.ops.convert_to_numpy(model.optimizer.dynamic_scale))
    assert scale == ref_scale, (what, scale, ref_scale)
    assert any(not np.array_equal(a, b) for a, b in zip(weights(model), start)), (what, "no step was taken")
    for w, v in zip(weights(model), weights(ref)):
        assert np.allclose(w, v, rtol=2e-3, atol=1e-4), (what, np.abs(w - v).max())
    everyone = hvd.allgather_object((weights(model), scale))
    for k, (ws, s) in enumerate(everyone):
        assert all(np.array_equal(a, b) for a, b in zip(ws, everyone[0][0])), (what, f"rank {k}'s weights differ")
        assert s == everyone[0][1], (what, f"rank {k}'s loss scale {s}, rank 0's {everyone[0][1]}")
    checks += 3

# Keras accumulates in a loss-scale optimizer's inner optimizer only: refused with what to do instead
try:
    hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05)),
                             backward_passes_per_step=2)
    raise AssertionError("backward_passes_per_step=2 around a LossScaleOptimizer was accepted")
except ValueError as e:
    assert "backward_passes_per_step=2" in str(e) and "LossScaleOptimizer(DistributedOptimizer(opt" in str(e), e
checks += 1

say(f"OK rank={r} checks={checks}")
