"""Compute replay: a torch model with a real network's gradients whose compute is a GPU's time, slept.

``build_model(load_profile("resnet50_v100"), dilate=10)`` gives an ``nn.Module`` whose parameters
have the real network's names and shapes (ResNet-50: 161 tensors, 25.6 M parameters) and whose
layers, one custom ``torch.autograd.Function`` each, sleep for the profile's forward and backward
times (``bench/profiles/*.json``; see ``aiacc.bench.replay_profiles`` for where the times come
from). ``time.sleep`` holds no core and releases the GIL, as a rank's CPU is free while its GPU
computes: communication then competes only with itself, as on a GPU cluster. Gradients appear in
backward, layer by layer in reverse order, with the real sizes, so DDP, aiacc's optimizer and any
other data-parallel wrapper run on the model unchanged.

Gradient values are cheap and checkable: a layer's backward writes, for every one of its
parameters, the constant ``coeff * sum(grad_output * input)`` (``coeff`` fixed per layer, from
its index), so with ``loss = model(x).mean()`` every element of every gradient is ``coeff *
mean(x)``. Ranks given different ``x`` get different gradients, and the average over ranks is
known in closed form (see ``expected_gradient``).

Training loops should keep gradients allocated (``opt.zero_grad(set_to_none=False)``): writing the
gradients then costs one pass over memory that stays mapped (BERT-base: ~15 ms of one core here)
instead of faulting in fresh memory every step (~150 ms). The bench loops do; any loop works.

Time: a layer's time is ``dilate x`` its profile time; the backward counts the CPU time it takes
to write its gradients as part of it (it sleeps for what remains). Every requested time is added
to ``model.clock`` (``requested_s``, ``sleeps``, ``slept_s``), which is how a test checks what a
step asked for without trusting a wall clock. ``dilate=0`` gives the same gradients with no
compute at all (the step is then pure communication).

torch is imported when a model is built, not when this module is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from .common import add_output_args, emit, positive_float, positive_int

__all__ = ["Profile", "LayerProfile", "ProfileError", "load_profile", "profile_names", "build_model", "Clock",
           "layer_coefficient", "expected_gradient", "no_update_optimizer", "main"]

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")


class ProfileError(Exception):
    """A profile that cannot be found or read; the message names it and what exists."""


@dataclass(frozen=True)
class LayerProfile:
    name: str
    params: Tuple[Tuple[str, Tuple[int, ...]], ...]
    flops: float
    forward_ms: float
    backward_ms: float

    @property
    def numel(self) -> int:
        return sum(_numel(shape) for _, shape in self.params)


@dataclass(frozen=True)
class Profile:
    name: str
    batch_size: int
    step_ms: float
    layers: Tuple[LayerProfile, ...]
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def tensors(self) -> List[Tuple[str, Tuple[int, ...]]]:
        """Every parameter tensor in forward order: (name, shape)."""
        return [p for lay in self.layers for p in lay.params]

    @property
    def parameters(self) -> int:
        return sum(lay.numel for lay in self.layers)

    @property
    def compute_ms(self) -> float:
        """Forward + backward of one step, as the layers add up (undilated)."""
        return sum(lay.forward_ms + lay.backward_ms for lay in self.layers)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def profile_names() -> List[str]:
    try:
        return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))
    except OSError:
        return []


def load_profile(name_or_path: str) -> Profile:
    """A stored profile by name (``resnet50_v100``, ``bert_base_v100``, ``cnn``, ``transformer``) or a
    JSON file by path."""
    path = name_or_path if os.path.sep in name_or_path or name_or_path.endswith(".json") else \
        os.path.join(PROFILE_DIR, name_or_path + ".json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ProfileError(f"no profile {name_or_path!r}: stored profiles are {', '.join(profile_names())} "
                           "(or give the path of a JSON profile)") from None
    except (OSError, ValueError) as exc:
        raise ProfileError(f"profile {path!r} cannot be read: {exc}") from None
    try:
        layers = tuple(LayerProfile(lay["name"], tuple((p["name"], tuple(p["shape"])) for p in lay["params"]),
                                    float(lay["flops"]), float(lay["forward_ms"]), float(lay["backward_ms"]))
                       for lay in raw["layers"])
        meta = {k: v for k, v in raw.items() if k != "layers"}
        return Profile(raw["name"], int(raw["batch_size"]), float(raw["step_ms"]), layers, meta)
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"profile {path!r} lacks or mistypes field {exc}") from None


class Clock:
    """What a replay model's layers asked for: ``requested_s`` (sum of dilated layer times),
    ``slept_s`` (the part actually slept, after the CPU the backward spent writing gradients) and
    ``sleeps`` (layer phases run, forward and backward each count one)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.requested_s = 0.0
        self.slept_s = 0.0
        self.sleeps = 0

    def spend(self, seconds: float, since: Optional[float] = None) -> None:
        """Take ``seconds`` of emulated compute; with ``since`` (a ``perf_counter`` reading), the
        time since then counts towards it."""
        self.requested_s += seconds
        self.sleeps += 1
        left = seconds - (time.perf_counter() - since if since is not None else 0.0)
        if left > 0:
            time.sleep(left)
            self.slept_s += left


def layer_coefficient(index: int) -> float:
    """The fixed gradient coefficient of layer ``index`` (small, distinct, exact in float32 sums)."""
    return (1 + index % 8) / 64.0


def expected_gradient(index: int, input_mean: float) -> float:
    """Every element of layer ``index``'s gradients for ``loss = model(x).mean()``, ``mean(x) = input_mean``."""
    return layer_coefficient(index) * input_mean


_FUNCTION = None
_NO_UPDATE = None


def no_update_optimizer(params):
    """A ``torch.optim.Optimizer`` whose ``step()`` changes nothing: the profile's layer times already
    hold the GPU's parameter update, which a CPU update here would count twice (SGD over BERT-base's
    110 M parameters costs this machine's core ~0.1 s per step). Wrappers (aiacc's
    DistributedOptimizer) still wait for their communication in ``step()``."""
    global _NO_UPDATE
    if _NO_UPDATE is None:
        import torch  # noqa: PLC0415

        class NoUpdate(torch.optim.Optimizer):
            def __init__(self, params):
                super().__init__(params, {})

            @torch.no_grad()
            def step(self, closure=None):
                return closure() if closure is not None else None

        _NO_UPDATE = NoUpdate
    return _NO_UPDATE(params)


def _function():
    """The autograd Function, defined once torch is imported."""
    global _FUNCTION
    if _FUNCTION is None:
        import torch  # noqa: PLC0415

        class ReplayLayer(torch.autograd.Function):
            @staticmethod
            def forward(ctx, layer, x, *params):
                layer.clock.spend(layer.forward_s)
                ctx.layer = layer
                ctx.save_for_backward(x)
                ctx.shapes = [(p.shape, p.dtype) for p in params]
                return x.clone()

            @staticmethod
            def backward(ctx, grad_out):
                start = time.perf_counter()
                (x,) = ctx.saved_tensors
                layer = ctx.layer
                value = layer.coeff * float((grad_out * x).sum())
                # one number broadcast to the parameter's shape: autograd adds it into an existing
                # .grad in place (zero_grad(set_to_none=False): one write pass over memory that stays
                # mapped) or copies it out once when .grad is None (fresh memory: ~10x slower here)
                grads = [torch.full((), value, dtype=dtype).expand(shape) for shape, dtype in ctx.shapes]
                layer.clock.spend(layer.backward_s, since=start)
                return (None, grad_out, *grads)

        _FUNCTION = ReplayLayer
    return _FUNCTION


class _Layer:
    """One layer's run-time record: its dilated times, coefficient and the model's clock."""

    __slots__ = ("name", "forward_s", "backward_s", "coeff", "clock")

    def __init__(self, name, forward_s, backward_s, coeff, clock):
        self.name, self.forward_s, self.backward_s, self.coeff, self.clock = name, forward_s, backward_s, coeff, clock


def build_model(profile: Profile, dilate: float = 1.0):
    """An ``nn.Module`` replaying ``profile`` with compute stretched ``dilate`` times (0: none).

    Input: a float tensor of shape ``(batch,)`` (any batch); output the same shape. Parameters start
    at zero (their values do not affect the replay), named as in the profile."""
    import torch  # noqa: PLC0415
    import torch.nn as nn  # noqa: PLC0415

    fn = _function()

    class Owner(nn.Module):
        """A module that holds parameters under their real names. Each layer's forward calls the
        owners of its parameters, so forward pre-hooks see them run, layer by layer, as in the real
        network (aiacc's overlap_forward updates a layer's parameters in its own pre-hook)."""

        def forward(self):
            return None

    class ReplayModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.profile = profile
            self.clock = Clock()
            self._replay = []  # (_Layer, [parameters], [owning modules])
            for index, lay in enumerate(profile.layers):
                params, owners = [], []
                for name, shape in lay.params:
                    param, owner = self._add(name, shape)
                    params.append(param)
                    if owner is not self and all(owner is not o for o in owners):
                        owners.append(owner)
                self._replay.append((_Layer(lay.name, 0.0, 0.0, layer_coefficient(index), self.clock), params,
                                     owners))
            self.set_dilate(dilate)

        def set_dilate(self, factor: float) -> None:
            """Stretch compute by ``factor`` from now on (0: none), keeping parameters and gradients."""
            if factor < 0:
                raise ValueError(f"dilate must be >= 0, got {factor}")
            self.dilate = factor
            for (record, _, _), lay in zip(self._replay, self.profile.layers):
                record.forward_s, record.backward_s = lay.forward_ms * 1e-3 * factor, lay.backward_ms * 1e-3 * factor

        def _add(self, dotted: str, shape):
            *path, leaf = dotted.split(".")
            module = self
            for part in path:
                child = module._modules.get(part)
                if child is None:
                    child = Owner()
                    module.add_module(part, child)
                module = child
            param = nn.Parameter(torch.zeros(tuple(shape)))
            module.register_parameter(leaf, param)
            return param, module

        def forward(self, x):
            for record, params, owners in self._replay:
                for owner in owners:
                    owner()
                x = fn.apply(record, x, *params)
            return x

        def layer_of(self) -> dict:
            """Parameter -> index of its layer (for checking the order gradients arrive in)."""
            return {id(p): i for i, (_, params, _) in enumerate(self._replay) for p in params}

    return ReplayModel()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m aiacc.bench replay --profile P [--dilate K] [--steps N]``: the profile's figures
    and one rank's replayed step (no communication)."""
    parser = argparse.ArgumentParser(prog="python -m aiacc.bench replay",
                                     description="a profile's layers, tensors and step time, replayed on one rank")
    parser.add_argument("--profile", default="resnet50_v100", help=f"one of {', '.join(profile_names())}, or a path")
    parser.add_argument("--dilate", type=positive_float, default=1.0, help="stretch compute by this factor")
    parser.add_argument("--steps", type=positive_int, default=3, help="steps to replay and time")
    add_output_args(parser)
    args = parser.parse_args(argv)
    if args.dilate < 0 or args.steps < 1:
        parser.error("--dilate must be >= 0 and --steps >= 1")
    try:
        profile = load_profile(args.profile)
    except ProfileError as exc:
        parser.error(str(exc))
    import torch  # noqa: PLC0415

    torch.set_num_threads(1)
    model = build_model(profile, args.dilate)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.ones(profile.batch_size)
    walls = []
    for _ in range(args.steps):
        model.clock.reset()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        model(x).mean().backward()
        opt.step()
        walls.append(time.perf_counter() - t0)
    emit([{"bench": "replay", "profile": profile.name, "layers": len(profile.layers),
           "tensors": len(profile.tensors), "params": profile.parameters, "batch": profile.batch_size,
           "samples_per_s_profile": profile.meta.get("samples_per_s"), "step_ms_profile": profile.step_ms,
           "dilate": args.dilate, "requested_ms": model.clock.requested_s * 1e3,
           "step_ms": sorted(walls)[len(walls) // 2] * 1e3}], args.json)
    return 0
