"""Horovod's collectives on ``torch.Tensor``, over aiacc's engine.

Tensors reach the engine without copies: a CPU tensor's memory is handed over
as a numpy view (``tensor.detach().numpy()``; bfloat16 through an int16 view),
a CUDA tensor's as a cupy array through DLPack (the engine reduces it with NCCL),
in-place forms pass that same view as the output, out-of-place forms pass a
view of a freshly allocated tensor, and collectives whose output shape is
known only on the engine thread (allgather, alltoall, reducescatter) give the
engine an ``allocate`` that returns views of new torch tensors. The only copy
an adapter makes is for a non-contiguous tensor (staged through a contiguous
one, and copied back for in-place forms).

Autograd flows through ``allreduce``, ``grouped_allreduce``, ``allgather``,
``broadcast`` and ``alltoall`` as in Horovod:

* allreduce: the gradient is the allreduce of the output gradient with the same op;
* allgather: this rank's rows of the averaged output gradient;
* broadcast: the averaged output gradient on the root, zeros elsewhere;
* alltoall: the output gradient sent back along the received splits.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import numpy as np
import torch

import aiacc
from aiacc.compression import as_compressor, bfloat16_dtype
from aiacc.ops import Average, Collective, as_reduce_op, average_or_op

__all__ = [
    "Handle", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather", "allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "synchronize", "poll", "barrier", "join", "to_numpy", "from_array",
]


# ---- torch <-> numpy without copies ------------------------------------------------------
def to_numpy(tensor: torch.Tensor, name: Optional[str]):
    """A writeable view of ``tensor``'s memory (no copy): numpy for CPU tensors, cupy (through
    DLPack) for CUDA tensors, which the engine then reduces with NCCL."""
    label = name or "(unnamed)"
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor {label!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type == "cuda":
        return _to_cupy(tensor, label)
    if tensor.device.type != "cpu":
        raise ValueError(f"tensor {label!r} is on {tensor.device}; aiacc.torch communicates CPU and CUDA tensors")
    if tensor.layout != torch.strided:
        raise ValueError(f"tensor {label!r} has layout {tensor.layout}; aiacc communicates dense tensors "
                         "(use .to_dense(), or DistributedOptimizer(sparse_as_dense=True))")
    t = tensor.detach() if tensor.requires_grad else tensor  # detach() costs a new tensor object
    if t.dtype == torch.bfloat16:
        bf16 = bfloat16_dtype()
        if bf16 is None:
            raise TypeError(f"bfloat16 tensor {label!r} needs ml_dtypes (pip install ml_dtypes)")
        return t.view(torch.int16).numpy().view(bf16)
    try:
        return t.numpy()
    except (TypeError, RuntimeError) as exc:
        raise TypeError(f"tensor {label!r} has dtype {t.dtype}, which aiacc does not support ({exc})") from None


def _to_cupy(tensor: torch.Tensor, label: str):
    try:
        import cupy  # noqa: PLC0415 - only for CUDA tensors
    except ImportError:
        raise RuntimeError(f"tensor {label!r} is a CUDA tensor: aiacc reduces CUDA tensors with NCCL through "
                           "cupy; pip install 'aiacc[gpu]'") from None
    if tensor.layout != torch.strided:
        raise ValueError(f"tensor {label!r} has layout {tensor.layout}; aiacc communicates dense tensors")
    if tensor.dtype == torch.bfloat16:
        raise TypeError(f"tensor {label!r}: bfloat16 CUDA tensors are not supported (cupy has no bfloat16); "
                        "use float16 or float32")
    t = tensor.detach() if tensor.requires_grad else tensor
    return cupy.from_dlpack(t)


def from_array(array, dtype: torch.dtype) -> torch.Tensor:
    """A torch tensor sharing ``array``'s memory: a numpy array (bfloat16 through an int16 view)
    or a CUDA array (DLPack)."""
    if not isinstance(array, np.ndarray):
        return torch.from_dlpack(array)
    if dtype == torch.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _allocator(dtype: torch.dtype, name: Optional[str], made: list, device=None) -> Callable:
    """``allocate(shape, np_dtype)`` for the engine: a view of a new torch tensor (on ``device``),
    kept in ``made``."""

    def allocate(shape, _np_dtype):
        t = torch.empty(tuple(int(s) for s in shape), dtype=dtype, device=device)
        made.append(t)
        return to_numpy(t, name)

    return allocate


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach() if tensor.requires_grad else tensor
    return t if t.is_contiguous() else t.contiguous()


# ---- handles ------------------------------------------------------------------------------
class Handle:
    """An operation in flight: pass it to :func:`synchronize` (result) or :func:`poll` (done?)."""

    __slots__ = ("_core", "_finish", "_value", "_finished", "name")

    def __init__(self, core, finish: Callable):
        self._core = core
        self._finish = finish
        self._value = None
        self._finished = False
        self.name = core.name

    def done(self) -> bool:
        return self._finished or self._core.done()

    def wait(self):
        if not self._finished:
            raw = self._core.wait()
            self._value = self._finish(raw)
            self._finished = True
            self._finish = None
        return self._value


def synchronize(handle):
    """Wait for an ``*_async`` operation and return its result (a tensor, or a list / tuple of them)."""
    return handle.wait()


def poll(handle) -> bool:
    """True if the operation behind ``handle`` has finished; never blocks."""
    return handle.done()


def _no_process_set(process_set, fn: str) -> None:
    if process_set is not None:
        raise NotImplementedError(f"{fn}: process sets are not supported by aiacc; every collective spans all ranks")


def _grad_name(name: Optional[str]) -> Optional[str]:
    return None if name is None else f"{name}.grad"


# ---- allreduce ------------------------------------------------------------------------------
def _submit_allreduce(tensors: Sequence[torch.Tensor], name, op, prescale, postscale, compression,
                      inplace: bool, group: bool, priority: float = 0.0) -> Handle:
    """Submit one (or a group of) allreduce(s); in place, or into new tensors."""
    sources = [_contiguous(t) for t in tensors]
    arrays = [to_numpy(s, name) for s in sources]
    if inplace:
        results, outputs = sources, arrays
    else:
        results = [torch.empty_like(s) for s in sources]
        outputs = [to_numpy(r, name) for r in results]
    core = aiacc.submit(Collective.ALLREDUCE, arrays if group else arrays[0], name=name, op=op,
                        prescale=prescale, postscale=postscale, compression=compression,
                        priority=priority, outputs=outputs)

    def finish(_):
        if not inplace:
            return results if group else results[0]
        with torch.no_grad():
            for t, s in zip(tensors, sources):
                if s.data_ptr() != t.data_ptr():  # staged copy of a non-contiguous tensor
                    t.copy_(s)
        return list(tensors) if group else tensors[0]

    return Handle(core, finish)


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale, compression):
        ctx.args = (name, op, prescale, postscale, compression)
        return _submit_allreduce([tensor], name, op, prescale, postscale, compression, False, False).wait()

    @staticmethod
    def backward(ctx, grad):
        name, op, prescale, postscale, compression = ctx.args
        out = _submit_allreduce([grad], _grad_name(name), op, prescale, postscale, compression, False, False).wait()
        return out, None, None, None, None, None


class _GroupedAllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale, postscale, compression, *tensors):
        ctx.args = (name, op, prescale, postscale, compression)
        return tuple(_submit_allreduce(tensors, name, op, prescale, postscale, compression, False, True).wait())

    @staticmethod
    def backward(ctx, *grads):
        name, op, prescale, postscale, compression = ctx.args
        out = _submit_allreduce(grads, _grad_name(name), op, prescale, postscale, compression, False, True).wait()
        return (None, None, None, None, None, *out)


def _wants_grad(tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=None, *, compression=None, priority: float = 0.0) -> Handle:
    """Start reducing ``tensor`` across ranks into a new tensor; ``synchronize`` the handle for it."""
    _no_process_set(process_set, "allreduce_async")
    return _submit_allreduce([tensor], name, average_or_op(average, op, "allreduce_async"), prescale_factor,
                             postscale_factor, compression, False, False, priority)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=None, *, compression=None, priority: float = 0.0) -> Handle:
    """Start reducing ``tensor`` across ranks in place."""
    _no_process_set(process_set, "allreduce_async_")
    return _submit_allreduce([tensor], name, average_or_op(average, op, "allreduce_async_"), prescale_factor,
                             postscale_factor, compression, True, False, priority)


def allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=None) -> torch.Tensor:
    """``tensor`` reduced across ranks with ``op`` (Average by default) as a new tensor; differentiable."""
    _no_process_set(process_set, "allreduce")
    op = average_or_op(average, op, "allreduce")
    if _wants_grad([tensor]):
        return _AllreduceFn.apply(tensor, name, op, prescale_factor, postscale_factor, compression)
    return _submit_allreduce([tensor], name, op, prescale_factor, postscale_factor, compression, False, False).wait()


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=None, *, compression=None) -> torch.Tensor:
    """Reduce ``tensor`` across ranks in place and return it."""
    return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set,
                            compression=compression).wait()


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=None, *, compression=None) -> Handle:
    """Start reducing a list of tensors as one unit (agreed and completed together)."""
    _no_process_set(process_set, "grouped_allreduce_async")
    return _submit_allreduce(list(tensors), name, average_or_op(average, op, "grouped_allreduce_async"),
                             prescale_factor, postscale_factor, compression, False, True)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=None, *, compression=None) -> Handle:
    _no_process_set(process_set, "grouped_allreduce_async_")
    return _submit_allreduce(list(tensors), name, average_or_op(average, op, "grouped_allreduce_async_"),
                             prescale_factor, postscale_factor, compression, True, True)


def grouped_allreduce(tensors, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=None) -> List[torch.Tensor]:
    """A list of tensors reduced as one unit, as new tensors; differentiable."""
    _no_process_set(process_set, "grouped_allreduce")
    tensors = list(tensors)
    op = average_or_op(average, op, "grouped_allreduce")
    if _wants_grad(tensors):
        return list(_GroupedAllreduceFn.apply(name, op, prescale_factor, postscale_factor, compression, *tensors))
    return _submit_allreduce(tensors, name, op, prescale_factor, postscale_factor, compression, False, True).wait()


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=None, *, compression=None) -> List[torch.Tensor]:
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set,
                                    compression=compression).wait()


# ---- allgather ------------------------------------------------------------------------------
def _submit_gather_like(kind: Collective, tensor: torch.Tensor, name, **kwargs) -> Handle:
    """Allgather / alltoall / reducescatter: the engine allocates the output as a torch tensor."""
    source = _contiguous(tensor)
    made: list = []
    core = aiacc.submit(kind, to_numpy(source, name), name=name,
                        allocate=_allocator(source.dtype, name, made, source.device), **kwargs)

    def finish(result):
        if kind == Collective.ALLTOALL:
            out, received = result
            out = made[-1] if made else from_array(out, source.dtype)
            return out, torch.from_numpy(np.asarray(received, dtype=np.int32))
        return made[-1] if made else from_array(result, source.dtype)

    return Handle(core, finish)


class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name):
        ctx.rows = tensor.shape[0]
        ctx.name = name
        return _submit_gather_like(Collective.ALLGATHER, tensor, name).wait()

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average, name=_grad_name(ctx.name))
        rows = allgather(torch.tensor([ctx.rows], dtype=torch.int64),
                         name=None if ctx.name is None else f"{ctx.name}.rows")
        offset = int(rows[:aiacc.rank()].sum())
        return reduced.narrow(0, offset, ctx.rows), None


def allgather_async(tensor, name=None, process_set=None) -> Handle:
    _no_process_set(process_set, "allgather_async")
    return _submit_gather_like(Collective.ALLGATHER, tensor, name)


def allgather(tensor, name=None, process_set=None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension (which may differ per rank)."""
    _no_process_set(process_set, "allgather")
    if _wants_grad([tensor]):
        return _AllgatherFn.apply(tensor, name)
    return _submit_gather_like(Collective.ALLGATHER, tensor, name).wait()


# ---- broadcast ------------------------------------------------------------------------------
def _submit_broadcast(tensor: torch.Tensor, root_rank: int, name, inplace: bool) -> Handle:
    source = _contiguous(tensor)
    array = to_numpy(source, name)
    result = source if inplace else torch.empty_like(source)
    core = aiacc.submit(Collective.BROADCAST, array, name=name, root=root_rank,
                        outputs=[array if inplace else to_numpy(result, name)])

    def finish(_):
        if inplace and source.data_ptr() != tensor.data_ptr():
            with torch.no_grad():
                tensor.copy_(source)
        return tensor if inplace else result

    return Handle(core, finish)


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name):
        ctx.root_rank = root_rank
        ctx.name = name
        return _submit_broadcast(tensor, root_rank, name, False).wait()

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average, name=_grad_name(ctx.name))
        if aiacc.rank() != ctx.root_rank:
            reduced.zero_()
        return reduced, None, None


def broadcast_async(tensor, root_rank, name=None, process_set=None) -> Handle:
    _no_process_set(process_set, "broadcast_async")
    return _submit_broadcast(tensor, root_rank, name, False)


def broadcast_async_(tensor, root_rank, name=None, process_set=None) -> Handle:
    _no_process_set(process_set, "broadcast_async_")
    return _submit_broadcast(tensor, root_rank, name, True)


def broadcast(tensor, root_rank, name=None, process_set=None) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank, as a new tensor; differentiable."""
    _no_process_set(process_set, "broadcast")
    if _wants_grad([tensor]):
        return _BroadcastFn.apply(tensor, root_rank, name)
    return _submit_broadcast(tensor, root_rank, name, False).wait()


def broadcast_(tensor, root_rank, name=None, process_set=None) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s and return it."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


# ---- alltoall, reducescatter --------------------------------------------------------------------
def _splits_list(splits):
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        return splits.detach().cpu().reshape(-1).tolist()
    return [int(s) for s in splits]


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name):
        out, received = _submit_gather_like(Collective.ALLTOALL, tensor, name, splits=splits).wait()
        ctx.received = received.tolist()
        ctx.name = name
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _):
        back, _ = _submit_gather_like(Collective.ALLTOALL, grad, _grad_name(ctx.name), splits=ctx.received).wait()
        return back, None, None


def alltoall_async(tensor, splits=None, name=None, process_set=None) -> Handle:
    """Start an alltoall; the handle's result is ``(tensor, received_splits)``."""
    _no_process_set(process_set, "alltoall_async")
    return _submit_gather_like(Collective.ALLTOALL, tensor, name, splits=_splits_list(splits))


def alltoall(tensor, splits=None, name=None, process_set=None):
    """Send ``splits[i]`` rows to rank i (equal parts if None); differentiable.

    Returns the received rows, and with ``splits`` given ``(rows, received_splits)``, as Horovod does.
    """
    _no_process_set(process_set, "alltoall")
    plain = _splits_list(splits)
    if _wants_grad([tensor]):
        out, received = _AlltoallFn.apply(tensor, plain, name)
    else:
        out, received = _submit_gather_like(Collective.ALLTOALL, tensor, name, splits=plain).wait()
    return out if splits is None else (out, received)


def reducescatter_async(tensor, name=None, compression=None, op=Average, process_set=None,
                        prescale_factor=1.0, postscale_factor=1.0) -> Handle:
    """Start a reducescatter (rank i keeps the i-th block of rows of the reduction)."""
    _no_process_set(process_set, "reducescatter_async")
    source = _contiguous(tensor)
    op = as_reduce_op(op)
    native = to_numpy(source, name).dtype
    wire = as_compressor(compression).wire_dtype(native)
    if wire == native:
        return _submit_gather_like(Collective.REDUCESCATTER, source, name, op=op, prescale=prescale_factor,
                                   postscale=postscale_factor)
    # The engine compresses allreduces only; Horovod compresses a reducescatter in the framework,
    # and so do we: reduce the narrow copy, widen the result.
    narrow = torch.float16 if wire == np.float16 else torch.bfloat16
    handle = _submit_gather_like(Collective.REDUCESCATTER, source.to(narrow), name, op=op,
                                 prescale=prescale_factor, postscale=postscale_factor)
    widen = handle._finish
    handle._finish = lambda result: widen(result).to(source.dtype)
    return handle


def reducescatter(tensor, name=None, compression=None, op=Average, process_set=None,
                  prescale_factor=1.0, postscale_factor=1.0) -> torch.Tensor:
    """``tensor`` reduced across ranks; rank i keeps the i-th block of rows (the first ``n % size`` one more)."""
    return reducescatter_async(tensor, name, compression, op, process_set, prescale_factor, postscale_factor).wait()


# ---- control ----------------------------------------------------------------------------------
def barrier(process_set=None) -> None:
    """Wait until every rank has called barrier()."""
    _no_process_set(process_set, "barrier")
    aiacc.barrier()


def join(device: int = -1) -> int:
    """This rank has no more data: take part in the others' allreduces with zeros until all have joined.

    Returns the rank that joined last. ``device`` is accepted for Horovod compatibility (CPU only).
    """
    return aiacc.join()
