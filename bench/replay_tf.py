"""Compute replay for TensorFlow 2 (eager): the profile's variables and times behind ``tf.custom_gradient``.

The same contract as :mod:`aiacc.bench.replay` (torch): ``build_model(load_profile("resnet50_v100"),
dilate=10)`` gives a ``tf.Module`` whose ``trainable_variables`` have the real names and shapes in
forward order; calling it on a float tensor of shape ``(batch,)`` runs each layer's forward
(sleeping its time, x dilate) and, under ``tf.GradientTape``, each layer's backward sleeps its time
and gives every one of its variables the gradient ``coeff * sum(dy * x)`` (with ``loss =
reduce_mean(model(x))``: ``expected_gradient(i, mean(x))``, the torch replay's values). Eager
execution only: inside ``tf.function`` a Python sleep would run once, when the function is traced.

TensorFlow is imported when a model is built, not when this module is imported.
"""

from __future__ import annotations

import time

from .replay import Clock, Profile, layer_coefficient

__all__ = ["build_model"]


def build_model(profile: Profile, dilate: float = 1.0):
    import tensorflow as tf  # noqa: PLC0415

    if dilate < 0:
        raise ValueError(f"dilate must be >= 0, got {dilate}")

    class ReplayModel(tf.Module):
        def __init__(self):
            super().__init__(name="replay")
            self.profile = profile
            self.dilate = dilate
            self.clock = Clock()
            self._layers = []  # (forward_s, backward_s, coeff, [variables])
            for index, lay in enumerate(profile.layers):
                variables = [tf.Variable(tf.zeros(shape), name=name, trainable=True) for name, shape in lay.params]
                self._layers.append((lay.forward_ms * 1e-3 * dilate, lay.backward_ms * 1e-3 * dilate,
                                     layer_coefficient(index), variables))

        @property
        def trainable_variables(self):  # forward order, as the profile lists them
            return [v for *_, variables in self._layers for v in variables]

        def __call__(self, x):
            for forward_s, backward_s, coeff, variables in self._layers:
                x = self._layer(x, forward_s, backward_s, coeff, variables)
            return x

        def _layer(self, x, forward_s, backward_s, coeff, variables):
            clock = self.clock

            @tf.custom_gradient
            def replay_layer(x, *values):
                clock.spend(forward_s)

                def grad(dy):
                    start = time.perf_counter()
                    value = coeff * float(tf.reduce_sum(dy * x))
                    grads = [tf.fill(tf.shape(v), tf.constant(value, v.dtype)) for v in values]
                    clock.spend(backward_s, since=start)
                    return (dy, *grads)

                return tf.identity(x), grad

            return replay_layer(x, *variables)

    return ReplayModel()
