"""Horovod's collectives on ``torch.Tensor``, over aiacc's engine.

Tensors reach the engine without copies (``arrays``: numpy views of CPU tensors, cupy arrays of CUDA ones): in-place
forms pass the tensor's own view as the output, out-of-place forms pass a view of a freshly allocated tensor, and
collectives whose output shape is known only on the engine thread (allgather, alltoall, reducescatter) give the
engine an ``allocate`` that returns views of new torch tensors. The only copy an adapter makes is for a non-
contiguous tensor (staged through a contiguous one, and copied back for in-place forms).

Autograd flows through ``allreduce``, ``grouped_allreduce``, ``allgather``, ``broadcast`` and ``alltoall``
as in Horovod: an allreduce's gradient is the allreduce of the output gradient (for Min, Max and Product the
op's derivative, ``_nonlinear_grads``); an allgather's, this rank's rows of the averaged output gradient; a
broadcast's, the averaged output gradient on the root, zeros elsewhere; an alltoall's, the output gradient
sent back along the received splits.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import numpy as np
import torch

import aiacc
# Horovod's mpi_ops holds the basics too (scripts do ``from horovod.torch.mpi_ops import Sum, rank``): the core's
from aiacc import (Adasum, Max, Min, Product, Sum, cross_rank, cross_size, init, is_homogeneous,  # noqa: F401
                   is_initialized, local_rank, local_size, mpi_threads_supported, rank, shutdown, size,
                   start_timeline, stop_timeline)
from aiacc.api import as_group, poll, synchronize  # (the core's: a handle's wait() / done())
from aiacc.api import _state as _api_state  # (its ``engine``: read inline by allreduce_async_)
from aiacc.compression import custom_compressor
from aiacc.names import derived_name
from aiacc.process_sets import HorovodBasics
from aiacc.ops import (Average, Collective, ReduceOp, as_reduce_op, average_or_op, check_sparse_op,
                       reducescatter_grad_scale)

from .arrays import (_VIEWS, _allocator, _contiguous, _group_views, _in_place_array, _refuse, _remember_group,
                     _resolved, _view_of, from_array, to_numpy)

__all__ = [
    "Handle", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather", "allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "grouped_allgather",
    "grouped_allgather_async", "grouped_reducescatter", "grouped_reducescatter_async", "sparse_allreduce_async",
    "synchronize", "poll", "barrier", "join", "to_numpy", "from_array",
]

# what Horovod's own tests read from its core (``hvd.mpi_ops._basics``): the registered process sets
_basics = HorovodBasics()


# ---- handles ------------------------------------------------------------------------------
class Handle:
    """An operation in flight: pass it to :func:`synchronize` (result) or :func:`poll` (done?)."""

    __slots__ = ("_core", "_finish", "_value", "_finished", "name")

    def __init__(self, core, finish: Optional[Callable], value=None):
        """``finish(raw result)`` makes the value, or, without it, the value is ``value`` (an
        in-place operation's own tensor)."""
        self._core, self._finish, self._value, self._finished, self.name = core, finish, value, False, core.name

    def done(self) -> bool:
        return self._finished or self._core.done()

    def wait(self, deadline: Optional[float] = None):
        """The value, once the operation is done; TimeoutError once ``deadline`` (``time.perf_counter()``) passed."""
        if not self._finished:
            raw = self._core.wait(None, deadline)
            if self._finish is not None:
                self._value = self._finish(raw)
                self._finish = None
            self._finished = True
        return self._value


# ---- allreduce ------------------------------------------------------------------------------
def _submit_allreduce(tensors: Sequence[torch.Tensor], name, op, prescale, postscale, compression,
                      inplace: bool, group: bool, priority: float = 0.0, process_set=None, wake: bool = True) -> Handle:
    """Submit one (or a group of) allreduce(s); in place, or into new tensors. ``wake`` False: the caller
    waits for it at once (``aiacc.submit_allreduce``)."""
    tensors = as_group(tensors, "grouped_allreduce", name) if group else tensors
    if inplace and not group:  # one tensor in place: the per-gradient call of a Horovod-style step
        t = tensors[0]
        array = _in_place_array(t)
        if array is not None:
            return Handle(aiacc.submit_allreduce(array, name, op, prescale, postscale, compression, priority,
                                                 [array], process_set, wake), None, t)
    arrays = key = None
    try:
        if inplace and group and name.__class__ is str:  # a named group: its views remembered
            arrays, key = _group_views(tensors, name)
            fast = key is not None
        else:
            fast = inplace and all(t.is_contiguous() and not t.requires_grad for t in tensors)
    except AttributeError:
        _refuse(tensors, name)
        raise
    if fast:
        # the common case: reduced where they lie, nothing to finish. numpy() refuses what to_numpy
        # handles or explains (CUDA, sparse, bfloat16, unsupported dtypes): then it takes over.
        if arrays is None:
            try:
                arrays = [t.numpy() for t in tensors]
                if key is not None:
                    _remember_group(name, key, arrays)
            except (TypeError, RuntimeError):
                # (a conjugate view, x.conj(): staged below, its values in memory of their own)
                arrays = (None if any(t.is_conj() or t.is_neg() for t in tensors)
                          else [to_numpy(t, name) for t in tensors])
        if arrays is not None:
            core = aiacc.submit(Collective.ALLREDUCE, arrays if group else arrays[0], name=name, op=op,
                                prescale=prescale, postscale=postscale, compression=compression, priority=priority,
                                outputs=arrays, process_set=process_set)
            return Handle(core, None, list(tensors) if group else tensors[0])
    sources = [_contiguous(t, name) for t in tensors]
    if inplace:  # (a conjugate view is staged: the result is copied back into it)
        sources = [_resolved(s) for s in sources]
    arrays = [to_numpy(s, name) for s in sources]
    if inplace:
        results, outputs = sources, arrays
    else:
        results = [torch.empty_like(s) for s in sources]
        outputs = [to_numpy(r, name) for r in results]
    core = aiacc.submit(Collective.ALLREDUCE, arrays if group else arrays[0], name=name, op=op,
                        prescale=prescale, postscale=postscale, compression=compression,
                        priority=priority, outputs=outputs, process_set=process_set)

    def finish(_):
        if not inplace:
            return results if group else results[0]
        with torch.no_grad():
            for t, s in zip(tensors, sources):
                if s.data_ptr() != t.data_ptr():  # staged copy of a non-contiguous tensor
                    t.copy_(s)
        return list(tensors) if group else tensors[0]

    return Handle(core, finish)


_NONLINEAR = (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale, compression, process_set):
        ctx.args = (name, op, prescale, postscale, compression)
        ctx.process_set = process_set
        out = _submit_allreduce([tensor], name, op, prescale, postscale, compression, False, False,
                                process_set=process_set).wait()
        if as_reduce_op(op) in _NONLINEAR:
            ctx.save_for_backward(tensor, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        name, op, prescale, postscale, compression = ctx.args
        if as_reduce_op(op) in _NONLINEAR:
            return _nonlinear_grads(ctx, [grad])[0], None, None, None, None, None, None
        out = _submit_allreduce([grad], derived_name(name, "grad"), op, prescale, postscale, compression, False, False,
                                process_set=ctx.process_set).wait()
        return out, None, None, None, None, None, None


class _GroupedAllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale, postscale, compression, process_set, *tensors):
        ctx.args = (name, op, prescale, postscale, compression)
        ctx.process_set = process_set
        out = tuple(_submit_allreduce(tensors, name, op, prescale, postscale, compression, False, True,
                                      process_set=process_set).wait())
        if as_reduce_op(op) in _NONLINEAR:
            ctx.save_for_backward(*tensors, *out)
        return out

    @staticmethod
    def backward(ctx, *grads):
        name, op, prescale, postscale, compression = ctx.args
        if as_reduce_op(op) in _NONLINEAR:
            return (None, None, None, None, None, None, *_nonlinear_grads(ctx, grads))
        out = _submit_allreduce(grads, derived_name(name, "grad"), op, prescale, postscale, compression, False, True,
                                process_set=ctx.process_set).wait()
        return (None, None, None, None, None, None, *out)


def _nonlinear_grads(ctx, grads) -> List[torch.Tensor]:
    """The gradients of an allreduce with op Min, Max or Product, of the sum of every rank's loss (as for Sum and
    Average): the ranks' incoming gradients summed, times the derivative of the op for this rank's input -- for Min
    and Max 1 where this rank's element is the result (split evenly between ranks that tie, as torch.amax does), 0
    elsewhere; for Product the other ranks' elements multiplied. Horovod reduced the incoming gradients with the op
    itself (Max of them), a wrong gradient on every rank."""
    name, op, prescale, postscale, _ = ctx.args
    op, process_set = as_reduce_op(op), ctx.process_set
    saved = ctx.saved_tensors
    inputs, outputs = saved[:len(grads)], saved[len(grads):]
    if prescale != 1 or postscale != 1:
        raise NotImplementedError(
            f"the gradient of allreduce {name or '(unnamed)'!r} with op={op.name.title()} and a prescale or postscale "
            "factor is not implemented: scale the tensor before or after the allreduce instead")
    total = _submit_allreduce(list(grads), derived_name(name, "grad"), ReduceOp.SUM, 1.0, 1.0, None, False, True,
                              process_set=process_set).wait()
    if op == ReduceOp.PRODUCT:
        # every rank's inputs in one grouped allgather (one request, not one per tensor)
        everys = grouped_allgather_async([x.detach().unsqueeze(0) for x in inputs], derived_name(name, "inputs"),
                                         process_set).wait()
        me, out = aiacc.set_rank(process_set), []
        for every, t in zip(everys, total):
            every[me] = 1
            out.append(t * every.prod(0))
        return out
    masks = [(x.detach() == y).to(x.dtype) for x, y in zip(inputs, outputs)]
    ties = _submit_allreduce(masks, derived_name(name, "ties"), ReduceOp.SUM, 1.0, 1.0, None, False, True,
                             process_set=process_set).wait()
    return [t * m / c for t, m, c in zip(total, masks, ties)]


def _wants_grad(tensors, name: Optional[str] = None) -> bool:
    try:
        return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    except AttributeError:
        _refuse(tensors, name)
        raise


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=None, *, compression=None, priority: float = 0.0) -> Handle:
    """Start reducing ``tensor`` across ranks into a new tensor; ``synchronize`` the handle for it."""
    return _submit_allreduce([tensor], name, average_or_op(average, op, "allreduce_async"), prescale_factor,
                             postscale_factor, compression, False, False, priority, process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=None, *, compression=None, priority: float = 0.0):
    """Start reducing ``tensor`` across ranks in place. The handle (pass it to ``synchronize`` or ``poll``;
    ``synchronize`` returns ``tensor``) is, for a named CPU tensor, the engine's own request."""
    if average is not None or op.__class__ is not ReduceOp:
        op = average_or_op(average, op, "allreduce_async_")
    engine = _api_state.engine  # (``running_engine()`` inlined: a call less per tensor)
    if engine is not None and process_set is None and name.__class__ is str:
        # the per-gradient call of a Horovod-style step, straight to the engine (``_submit_allreduce``'s
        # first branch without its list, two calls and a Handle: the request returns ``tensor`` itself),
        # with the numpy view remembered under the name (``_view_of``, inlined: a call less per tensor)
        try:
            ptr, shape, dtype, array = _VIEWS[name]
            if ptr != tensor.data_ptr() or dtype is not tensor.dtype or shape != tensor.shape \
                    or not tensor.is_contiguous():
                array = _view_of(tensor, name)
        except KeyError:
            array = _view_of(tensor, name)
        except AttributeError:  # not a tensor: _submit_allreduce explains
            array = None
        if array is not None:
            return engine.submit_allreduce(array, name, op, prescale_factor, postscale_factor, compression,
                                           priority, [array], None, True, tensor)
    return _submit_allreduce([tensor], name, op, prescale_factor, postscale_factor, compression, True, False,
                             priority, process_set)


def allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=None) -> torch.Tensor:
    """``tensor`` reduced across ranks with ``op`` (Average by default) as a new tensor; differentiable."""
    op = average_or_op(average, op, "allreduce")
    custom = custom_compressor(compression)
    if custom is not None:  # Horovod's way with a compressor of one's own: compress, reduce, decompress
        compressed, ctx = custom.compress(tensor)
        return custom.decompress(allreduce(compressed, None, name, None, op, prescale_factor, postscale_factor,
                                           process_set), ctx)
    if _wants_grad([tensor], name):
        return _AllreduceFn.apply(tensor, name, op, prescale_factor, postscale_factor, compression, process_set)
    return _submit_allreduce([tensor], name, op, prescale_factor, postscale_factor, compression, False, False,
                             process_set=process_set).wait()


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=None, *, compression=None) -> torch.Tensor:
    """Reduce ``tensor`` across ranks in place and return it."""
    return _submit_allreduce([tensor], name, average_or_op(average, op, "allreduce_"), prescale_factor,
                             postscale_factor, compression, True, False, 0.0, process_set, False).wait()


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=None, *, compression=None) -> Handle:
    """Start reducing a list of tensors as one unit (agreed and completed together)."""
    return _submit_allreduce(tensors, name, average_or_op(average, op, "grouped_allreduce_async"),
                             prescale_factor, postscale_factor, compression, False, True, process_set=process_set)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=None, *, compression=None) -> Handle:
    return _submit_allreduce(tensors, name, average_or_op(average, op, "grouped_allreduce_async_"),
                             prescale_factor, postscale_factor, compression, True, True, process_set=process_set)


def grouped_allreduce(tensors, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=None) -> List[torch.Tensor]:
    """A list of tensors reduced as one unit, as new tensors; differentiable."""
    tensors = as_group(tensors, "grouped_allreduce", name)
    op = average_or_op(average, op, "grouped_allreduce")
    custom = custom_compressor(compression)
    if custom is not None:  # (as allreduce)
        pairs = [custom.compress(t) for t in tensors]
        out = grouped_allreduce([c for c, _ in pairs], None, name, None, op, prescale_factor, postscale_factor,
                                process_set)
        return [custom.decompress(o, ctx) for o, (_, ctx) in zip(out, pairs)]
    if _wants_grad(tensors, name):
        return list(_GroupedAllreduceFn.apply(name, op, prescale_factor, postscale_factor, compression, process_set,
                                              *tensors))
    return _submit_allreduce(tensors, name, op, prescale_factor, postscale_factor, compression, False, True,
                             process_set=process_set).wait()


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=None, *, compression=None) -> List[torch.Tensor]:
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set,
                                    compression=compression).wait()


# ---- allgather ------------------------------------------------------------------------------
def _submit_gather_like(kind: Collective, tensors, name, group: bool = False, process_set=None,
                        received_on=None, **kwargs) -> Handle:
    """Allgather / alltoall / reducescatter (one tensor or a group): the engine allocates each output
    as a new torch tensor; an alltoall's received splits land on ``received_on`` (the device of the
    splits tensor given, as in Horovod) or on the CPU."""
    sources = [_contiguous(t, name) for t in (as_group(tensors, f"grouped_{kind}", name) if group else [tensors])]
    made: list = []
    allocators = iter([_allocator(s.dtype, name, made, s.device) for s in sources])
    core = aiacc.submit(kind, [to_numpy(s, name) for s in sources] if group else to_numpy(sources[0], name),
                        name=name, allocate=lambda shape, dtype: next(allocators)(shape, dtype),
                        process_set=process_set, **kwargs)

    def finish(result):
        if kind == Collective.ALLTOALL:
            out, received = result
            out = made[-1] if made else from_array(out, sources[0].dtype)
            received = torch.from_numpy(np.asarray(received, dtype=np.int32))
            return out, received if received_on is None else received.to(received_on)
        if group:
            return made if len(made) == len(sources) else [from_array(r, s.dtype) for r, s in zip(result, sources)]
        return made[-1] if made else from_array(result, sources[0].dtype)

    return Handle(core, finish)


class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        handle = _submit_gather_like(Collective.ALLGATHER, tensor, name, process_set=process_set)  # (checks first)
        ctx.rows = tensor.shape[0]
        ctx.name = name
        ctx.process_set = process_set
        return handle.wait()

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average, name=derived_name(ctx.name, "grad"), process_set=ctx.process_set)
        rows = allgather(torch.tensor([ctx.rows], dtype=torch.int64),
                         name=derived_name(ctx.name, "rows"), process_set=ctx.process_set)
        offset = int(rows[:aiacc.set_rank(ctx.process_set)].sum())
        return reduced.narrow(0, offset, ctx.rows), None, None


def allgather_async(tensor, name=None, process_set=None) -> Handle:
    return _submit_gather_like(Collective.ALLGATHER, tensor, name, process_set=process_set)


def allgather(tensor, name=None, process_set=None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension (which may differ per rank)."""
    if _wants_grad([tensor], name):
        return _AllgatherFn.apply(tensor, name, process_set)
    return _submit_gather_like(Collective.ALLGATHER, tensor, name, process_set=process_set).wait()


def grouped_allgather_async(tensors, name=None, process_set=None) -> Handle:
    """Start gathering a list of tensors as one unit."""
    return _submit_gather_like(Collective.ALLGATHER, tensors, name, group=True, process_set=process_set)


def grouped_allgather(tensors, name=None, process_set=None) -> List[torch.Tensor]:
    """``allgather`` of each tensor of the list, as one unit; differentiable tensor by tensor."""
    tensors = as_group(tensors, "grouped_allgather", name)
    if _wants_grad(tensors, name):
        return [allgather(t, None if name is None else f"{name}.{i}", process_set) for i, t in enumerate(tensors)]
    return grouped_allgather_async(tensors, name, process_set).wait()


# ---- sparse ---------------------------------------------------------------------------------
def sparse_allreduce_async(tensor, name, op, process_set=None):
    """Reduce a sparse COO tensor across ranks by allgathering its indices and values (Horovod's way);
    returns a function that waits and gives the sparse result (values averaged for ``op=Average``;
    indices that several ranks hold appear once per rank, to be summed by a later coalesce)."""
    if not tensor.is_sparse:
        raise ValueError(f"sparse_allreduce_async of {name!r}: expected a sparse COO tensor, got layout "
                         f"{tensor.layout}")
    op = check_sparse_op(op, f"sparse_allreduce_async of {name!r}")
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    # allgather concatenates along the first dimension: the indices travel transposed
    indices = allgather_async(t._indices().transpose(0, 1).contiguous(), name=f"{name}.indices",
                              process_set=process_set)
    values = allgather_async(t._values().contiguous(), name=f"{name}.values", process_set=process_set)
    ranks = aiacc.set_size(process_set)

    def result():
        v, i = values.wait(), indices.wait()
        if op == Average:
            v = v / ranks
        return torch.sparse_coo_tensor(i.transpose(0, 1), v, t.size(), check_invariants=False)  # (valid on every rank)

    return result


# ---- broadcast ------------------------------------------------------------------------------
def _submit_broadcast(tensor: torch.Tensor, root_rank: int, name, inplace: bool, process_set=None) -> Handle:
    source = _contiguous(tensor, name)
    if inplace:  # (a conjugate view is staged: the result is copied back into it)
        source = _resolved(source)
    array = to_numpy(source, name)
    result = source if inplace else torch.empty_like(source)
    core = aiacc.submit(Collective.BROADCAST, array, name=name, root=root_rank,
                        outputs=[array if inplace else to_numpy(result, name)], process_set=process_set)

    def finish(_):
        if inplace and source.data_ptr() != tensor.data_ptr():
            with torch.no_grad():
                tensor.copy_(source)
        return tensor if inplace else result

    return Handle(core, finish)


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank = root_rank
        ctx.name = name
        ctx.process_set = process_set
        return _submit_broadcast(tensor, root_rank, name, False, process_set).wait()

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average, name=derived_name(ctx.name, "grad"), process_set=ctx.process_set)
        if aiacc.rank() != ctx.root_rank:
            reduced.zero_()
        return reduced, None, None, None


def broadcast_async(tensor, root_rank, name=None, process_set=None) -> Handle:
    return _submit_broadcast(tensor, root_rank, name, False, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=None) -> Handle:
    return _submit_broadcast(tensor, root_rank, name, True, process_set)


def broadcast(tensor, root_rank, name=None, process_set=None) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank, as a new tensor; differentiable. ``root_rank`` is a rank
    of the job, also with a process set."""
    if _wants_grad([tensor], name):
        return _BroadcastFn.apply(tensor, root_rank, name, process_set)
    return _submit_broadcast(tensor, root_rank, name, False, process_set).wait()


def broadcast_(tensor, root_rank, name=None, process_set=None) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s and return it."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


# ---- alltoall, reducescatter --------------------------------------------------------------------
def _splits_list(splits):
    """``splits`` as the core takes them (a tensor as a numpy array): the core checks them, with one message
    for every framework (whole numbers, one per rank, summing to the rows)."""
    if isinstance(splits, torch.Tensor):
        return splits.detach().cpu().reshape(-1).numpy()
    return splits


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = _submit_gather_like(Collective.ALLTOALL, tensor, name, splits=splits,
                                            process_set=process_set).wait()
        ctx.received = received.tolist()
        ctx.name = name
        ctx.process_set = process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _):
        back, _ = _submit_gather_like(Collective.ALLTOALL, grad, derived_name(ctx.name, "grad"), splits=ctx.received,
                                      process_set=ctx.process_set).wait()
        return back, None, None, None


def alltoall_async(tensor, splits=None, name=None, process_set=None) -> Handle:
    """Start an alltoall; the handle's result is ``(tensor, received_splits)``."""
    return _submit_gather_like(Collective.ALLTOALL, tensor, name, splits=_splits_list(splits),
                               process_set=process_set, received_on=_device_of_splits(splits))


def _device_of_splits(splits):
    """Where the received splits go: the device of a CUDA ``splits`` tensor, else None (the CPU)."""
    return splits.device if isinstance(splits, torch.Tensor) and splits.is_cuda else None


def alltoall(tensor, splits=None, name=None, process_set=None):
    """Send ``splits[i]`` rows to rank i (equal parts if None); differentiable.

    Returns the received rows, and with ``splits`` given ``(rows, received_splits)``, as Horovod does.
    """
    plain, where = _splits_list(splits), _device_of_splits(splits)
    if _wants_grad([tensor], name):
        out, received = _AlltoallFn.apply(tensor, plain, name, process_set)
        received = received if where is None else received.to(where)
    else:
        out, received = _submit_gather_like(Collective.ALLTOALL, tensor, name, splits=plain,
                                            process_set=process_set, received_on=where).wait()
    return out if splits is None else (out, received)


class _ReducescatterFn(torch.autograd.Function):
    """Horovod's gradient of a reducescatter: the output gradient allgathered, times the job's size
    for Sum and the scale factors (so that, as for allreduce, it is the average over ranks)."""

    @staticmethod
    def forward(ctx, name, op, prescale, postscale, compression, process_set, *tensors):
        ctx.args = (op, prescale, postscale, process_set)
        handle = _submit_gather_like(Collective.REDUCESCATTER, list(tensors), name, group=True, op=op,
                                     prescale=prescale, postscale=postscale, compression=compression,
                                     process_set=process_set)
        return tuple(handle.wait())

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, process_set = ctx.args
        factor = reducescatter_grad_scale(op, aiacc.set_size(process_set), prescale, postscale)
        scaled = [g * factor if factor != 1 else g for g in grads]
        return (None, None, None, None, None, None, *(allgather(g, process_set=process_set) for g in scaled))


def reducescatter_async(tensor, name=None, op=Average, process_set=None, prescale_factor=1.0, postscale_factor=1.0,
                        compression=None) -> Handle:
    """Start a reducescatter (rank i keeps the i-th block of rows of the reduction), with Horovod's
    arguments in Horovod's order; ``compression`` (aiacc's, last) casts on the wire in the engine."""
    return _submit_gather_like(Collective.REDUCESCATTER, tensor, name, op=as_reduce_op(op), prescale=prescale_factor,
                               postscale=postscale_factor, compression=compression, process_set=process_set)


def reducescatter(tensor, name=None, compression=None, op=Average, process_set=None,
                  prescale_factor=1.0, postscale_factor=1.0) -> torch.Tensor:
    """``tensor`` reduced across ranks; rank i keeps the i-th block of rows (the first ``n % size`` one
    more); differentiable."""
    custom = custom_compressor(compression)
    if custom is not None:  # (as allreduce: Horovod compresses around its reducescatter too)
        small, ctx = custom.compress(tensor)
        out = reducescatter(small, name, None, op, process_set, prescale_factor, postscale_factor)
        return custom.decompress(out, ctx)
    if _wants_grad([tensor], name):
        return _ReducescatterFn.apply(name, as_reduce_op(op), prescale_factor, postscale_factor, compression,
                                      process_set, tensor)[0]
    return reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor, compression).wait()


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=None, prescale_factor=1.0,
                                postscale_factor=1.0, compression=None) -> Handle:
    """Start a reducescatter of each tensor of the list, as one unit (Horovod's argument order)."""
    return _submit_gather_like(Collective.REDUCESCATTER, tensors, name, group=True, op=as_reduce_op(op),
                               prescale=prescale_factor, postscale=postscale_factor, compression=compression,
                               process_set=process_set)


def grouped_reducescatter(tensors, name=None, compression=None, op=Average, process_set=None,
                          prescale_factor=1.0, postscale_factor=1.0) -> List[torch.Tensor]:
    """``reducescatter`` of each tensor of the list, as one unit; differentiable."""
    tensors = as_group(tensors, "grouped_reducescatter", name)
    custom = custom_compressor(compression)
    if custom is not None:  # (as allreduce)
        cs = [custom.compress(t) for t in tensors]
        out = grouped_reducescatter([c for c, _ in cs], name, None, op, process_set, prescale_factor, postscale_factor)
        return [custom.decompress(o, ctx) for o, (_, ctx) in zip(out, cs)]
    if _wants_grad(tensors, name):
        return list(_ReducescatterFn.apply(name, as_reduce_op(op), prescale_factor, postscale_factor, compression,
                                           process_set, *tensors))
    return grouped_reducescatter_async(tensors, name, op, process_set, prescale_factor, postscale_factor,
                                       compression).wait()


# ---- control ----------------------------------------------------------------------------------
def barrier(process_set=None) -> None:
    """Wait until every rank (of ``process_set``) has called barrier()."""
    aiacc.barrier(process_set=process_set)


def join(device: int = -1) -> int:
    """This rank has no more data: take part in the others' allreduces with zeros until all have joined.

    Returns the rank that joined last. ``device`` is accepted for Horovod compatibility (CPU only).
    """
    return aiacc.join()

