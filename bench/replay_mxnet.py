"""Compute replay for MXNet 1.9 Gluon: the profile's parameters and times behind ``mx.autograd.Function``.

The same contract as :mod:`aiacc.bench.replay` (torch): ``build_model(load_profile("cnn"), dilate)``
gives an initialised ``gluon.Block`` whose parameters have the profile's shapes in forward order
(``model.replay_params``; Gluon names them ``replay_<name with _ for .>``); calling it on an NDArray
of shape ``(batch,)`` inside ``autograd.record()`` sleeps each layer's forward time (x dilate), and
``backward()`` sleeps each layer's backward time and gives every one of its parameters the
gradient ``coeff * sum(dy * x)`` (with ``loss = model(x).mean()``: ``expected_gradient(i,
mean(x))``, the torch replay's values). Not hybridizable (the sleeps are Python).

MXNet is imported (through ``aiacc.mxnet``, which restores ``numpy.bool`` first) when a model is
built, not when this module is imported.
"""

from __future__ import annotations

import time

from .replay import Clock, Profile, layer_coefficient

__all__ = ["build_model"]


def build_model(profile: Profile, dilate: float = 1.0):
    import aiacc.mxnet  # noqa: F401, PLC0415 - numpy.bool for MXNet 1.9.1, before mxnet itself
    import mxnet as mx  # noqa: PLC0415
    from mxnet import gluon, nd  # noqa: PLC0415

    if dilate < 0:
        raise ValueError(f"dilate must be >= 0, got {dilate}")

    class ReplayLayer(mx.autograd.Function):
        def __init__(self, clock, forward_s, backward_s, coeff):
            super().__init__()
            self.clock, self.forward_s, self.backward_s, self.coeff = clock, forward_s, backward_s, coeff

        def forward(self, x, *params):
            self.clock.spend(self.forward_s)
            self.save_for_backward(x)
            self.shapes = [(p.shape, p.dtype) for p in params]
            return x.copy()

        def backward(self, dy):
            start = time.perf_counter()
            (x,) = self.saved_tensors
            value = self.coeff * float((dy * x).sum().asscalar())
            grads = [nd.full(shape, value, dtype=dtype) for shape, dtype in self.shapes]
            self.clock.spend(self.backward_s, since=start)
            return (dy, *grads)

    class ReplayModel(gluon.Block):
        def __init__(self):
            super().__init__(prefix="replay_")
            self.profile = profile
            self.dilate = dilate
            self.clock = Clock()
            self._layers = []  # (forward_s, backward_s, coeff, [Parameter])
            with self.name_scope():
                for index, lay in enumerate(profile.layers):
                    params = [self.params.get(name.replace(".", "_"), shape=tuple(shape), init=mx.init.Zero())
                              for name, shape in lay.params]
                    self._layers.append((lay.forward_ms * 1e-3 * dilate, lay.backward_ms * 1e-3 * dilate,
                                         layer_coefficient(index), params))

        @property
        def replay_params(self):
            """The parameters in forward order, as the profile lists them."""
            return [p for *_, params in self._layers for p in params]

        def forward(self, x):
            if x.grad is None:
                # MXNet 1.9 drops every gradient an autograd.Function returns when its first input is
                # not part of the graph (measured): make the input a leaf that takes a gradient
                x = x.copy()
                x.attach_grad()
            for forward_s, backward_s, coeff, params in self._layers:
                x = ReplayLayer(self.clock, forward_s, backward_s, coeff)(x, *[p.data() for p in params])
            return x

    model = ReplayModel()
    model.initialize()
    return model
