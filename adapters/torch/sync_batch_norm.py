"""Synchronized batch normalization (Horovod's ``hvd.SyncBatchNorm``), over the aiacc engine.

In training, the statistics of each forward are those of the whole global batch: every rank gathers
all ranks' per-channel mean, inverse standard deviation and row count in one allgather (counts may
differ: uneven and even empty per-rank batches are fine), and the backward sums the two per-channel
gradient terms across ranks in one allreduce, so outputs and input gradients equal those of one
``BatchNorm`` over the global batch, and the running statistics are updated as that one would (unbiased
variance over the global count). In eval mode with running statistics, or in a job of one rank, it is
plain batch norm; in eval mode without them (``track_running_stats=False``) it normalizes by the global
batch's statistics, as Horovod's does, so every rank of the set must run that forward too. The
weight and bias gradients stay local: ``DistributedOptimizer`` (or DDP) averages them with the rest.
"""

from __future__ import annotations

import collections

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

import aiacc
from aiacc.exceptions import TensorMismatchError

from . import mpi_ops

__all__ = ["SyncBatchNorm"]


_calls: "collections.Counter" = collections.Counter()


def _name(step: str, process_set) -> str:
    """The collective's name: SyncBatchNorm's own, numbered by call (as unnamed ones are, so the ranks match their
    layers by the order they run them), per process set. Unnamed, a stall (a rank validating in eval() while another
    trains) named 'allgather.noname.3', nothing that pointed at SyncBatchNorm."""
    key = (step, getattr(process_set, "process_set_id", None))
    _calls[key] += 1
    return f"SyncBatchNorm.{step}.{_calls[key]}"


def _per_channel(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-channel vector shaped to broadcast over ``like`` (N, C, ...)."""
    return v.view(1, -1, *([1] * (like.dim() - 2)))


class _SyncBatchNormFn(torch.autograd.Function):
    """Batch norm over the global batch, written with plain tensor operations (torch's fused
    ``batch_norm_stats`` family exists for CUDA only), so it runs on CPU and GPU alike."""

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum, process_set):
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        rows = input.numel() // channels
        acc = torch.promote_types(input.dtype, torch.float32)
        x = input.to(acc)
        if rows > 0:
            mean = x.mean(dims)
            m2 = ((x - _per_channel(mean, x)) ** 2).sum(dims)
        else:  # an empty batch still takes part, with a count of 0
            mean = m2 = torch.zeros(channels, dtype=acc)
        # what this rank's backward does: 2 = it needs the input's gradient (the backward allreduce), 1 = the
        # weight's only, 0 = no backward at all. Any rank's 2 has every rank with a backward take part in the
        # allreduce (before, a rank whose input needed no gradient skipped it, and the others waited for ever)
        need = ctx.needs_input_grad
        role = 2.0 if need[0] else 1.0 if any(need[1:3]) else 0.0
        mine = torch.cat([mean, m2, torch.tensor([float(rows), role], dtype=acc)])
        # one allgather of every rank's (mean, sum of squared deviations, count, role): counts may differ
        try:
            every = mpi_ops.allgather_async(mine.unsqueeze(0), name=_name("forward", process_set),
                                            process_set=process_set).wait()
        except TensorMismatchError as e:  # (it names the allgather and widths 2 x channels + 2 only)
            if "dtype differs" in str(e):  # (not a matter of channels: it said so)
                raise TensorMismatchError(f"SyncBatchNorm: the ranks' inputs differ in dtype: {e}") from e
            if "join()" in str(e):  # (a rank that joined takes no part: nothing to do with channels)
                raise TensorMismatchError(f"SyncBatchNorm: {e}") from e
            raise TensorMismatchError(
                f"SyncBatchNorm: this rank's layer has {channels} channels, and the ranks' statistics (2 x channels + "
                f"2 values) differ: {e}. Every rank must run the same SyncBatchNorm layers in the same order") from e
        means, m2s, counts = every[:, :channels], every[:, channels:2 * channels], every[:, 2 * channels:-1]
        roles = every[:, -1].tolist()
        if 2.0 in roles and 0.0 in roles:
            ranks = getattr(process_set, "ranks", None) or list(range(len(roles)))
            idle = [q for q, role in zip(ranks, roles) if role == 0.0]
            raise ValueError(
                f"SyncBatchNorm: the input of this layer needs a gradient on rank {ranks[roles.index(2.0)]}, whose "
                f"backward sums the input gradient's terms with every rank's, and on rank"
                f"{'s' if len(idle) > 1 else ''} {', '.join(map(str, idle))} neither its input nor its weight and bias "
                "need one (no backward runs there, and the others would wait for it for ever): freeze the same "
                "layers on every rank")
        ctx.reduce = 2.0 in roles
        total = counts.sum()
        if total < 1:
            raise ValueError("SyncBatchNorm: every rank's batch is empty")
        mean = (counts * means).sum(0) / total
        m2 = (m2s + counts * (means - mean) ** 2).sum(0)
        invstd = torch.rsqrt(m2 / total + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                unbiased = m2 / (total - 1) if total > 1 else m2
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.total, ctx.process_set = total, process_set
        xhat = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
        if weight is not None:
            xhat = xhat * _per_channel(weight.to(acc), x) + _per_channel(bias.to(acc), x)
        return xhat.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, mean, invstd = ctx.saved_tensors
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        acc = mean.dtype
        x, dy = input.to(acc), grad_output.to(acc)
        xmu = x - _per_channel(mean, x)
        local = torch.cat([dy.sum(dims), (dy * xmu).sum(dims)]) if input.numel() else torch.zeros(2 * channels,
                                                                                                   dtype=acc)
        grad_input = grad_weight = grad_bias = None
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        if weight is not None and need_weight:
            grad_weight = (local[channels:] * invstd).to(weight.dtype)
        if weight is not None and need_bias:
            grad_bias = local[:channels].to(weight.dtype)
        if ctx.reduce:  # (every rank with a backward, when any rank needs its input's gradient)
            both = mpi_ops.allreduce_async(local, name=_name("backward", ctx.process_set), op=aiacc.Sum,
                                           process_set=ctx.process_set).wait()
        if need_input:
            sum_dy, sum_dy_xmu = both[:channels] / ctx.total, both[channels:] / ctx.total
            scale = invstd if weight is None else invstd * weight.to(acc)
            grad = (dy - _per_channel(sum_dy, x) - xmu * _per_channel(invstd * invstd * sum_dy_xmu, x))
            grad_input = (grad * _per_channel(scale, x)).to(input.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def _sync_batch_norm_eager(*args):
    return _SyncBatchNormFn.apply(*args)


# torch.compile runs this as it is (a graph break): it talks to the engine, which no graph can hold. Made by
# the first SyncBatchNorm, not at import: torch.compiler.disable imports dynamo (~0.85 s per process).
_sync_batch_norm = None


def _make_sync_batch_norm() -> None:
    global _sync_batch_norm
    if _sync_batch_norm is None:
        _sync_batch_norm = torch.compiler.disable(_sync_batch_norm_eager)


class SyncBatchNorm(_BatchNorm):
    """``nn.BatchNorm1d/2d/3d`` whose training statistics are those of the global batch across the ranks
    (of ``process_set``, default all; or ``process_group``, torch's name: a group of the ``aiacc``
    torch.distributed backend, such as a sub-group from ``dist.new_group([0, 2])``). Drop-in: same arguments,
    parameters, buffers and state dict; ``SyncBatchNorm.convert_sync_batchnorm(model)`` swaps every BatchNorm
    of a model, as torch's does."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 device=None, dtype=None, process_set=None, process_group=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_set = _set_of(process_set, process_group)
        _make_sync_batch_norm()

    def __setstate__(self, state):  # unpickled (torch.load of a whole model): no __init__ ran
        super().__setstate__(state)
        _make_sync_batch_norm()

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected an input of at least 2 dimensions (N, C, ...), got "
                             f"{input.dim()}D of shape {tuple(input.shape)}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}): input has {input.shape[1]} channels "
                             f"(shape {tuple(input.shape)})")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch_stats = self.training or self.running_mean is None
        running_mean = self.running_mean if not self.training or self.track_running_stats else None
        running_var = self.running_var if not self.training or self.track_running_stats else None
        # eval mode without running statistics normalizes by the global batch's statistics, a collective as in
        # training, as Horovod's does (torch's nn.SyncBatchNorm uses each rank's own batch there)
        if not use_batch_stats or aiacc.set_size(self.process_set) == 1:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, use_batch_stats, factor,
                                self.eps)
        return _sync_batch_norm(input, self.weight, self.bias, running_mean, running_var, self.eps, factor,
                                self.process_set)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, process_set=None, process_group=None) -> torch.nn.Module:
        """``module`` with every ``nn.BatchNorm*d`` replaced by a SyncBatchNorm holding its parameters and
        running statistics (the module itself when it is one); ``process_group``: as in ``SyncBatchNorm``."""
        process_set = _set_of(process_set, process_group)
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
            out = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats,
                      process_set=process_set)
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_set))
        return out


def _set_of(process_set, process_group):
    """The process set of ``process_group`` (a group of the ``aiacc`` torch.distributed backend: its sub-group's
    set, None for a group of every rank), or ``process_set`` when no group is given."""
    if process_group is None:
        return process_set
    from .backend import AiaccProcessGroup  # noqa: PLC0415

    if process_set is not None:
        raise ValueError("SyncBatchNorm: pass process_set or process_group, not both")
    if not isinstance(process_group, AiaccProcessGroup):
        raise ValueError(f"SyncBatchNorm: process_group must be a group of the aiacc backend (dist.new_group after "
                         f"dist.init_process_group('aiacc')) that holds this rank, got {process_group!r}")
    return process_group._set
