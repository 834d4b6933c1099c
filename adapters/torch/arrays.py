"""torch tensors as the engine's arrays and back, without copies (the seam's first and last steps).

A CPU tensor's memory is handed over as a numpy view (``tensor.detach().numpy()``; bfloat16 through an int16
view), a CUDA tensor's as a cupy array through DLPack (the engine reduces it with NCCL); results come back as
torch tensors over the engine's arrays (``from_array``), or the engine allocates them as views of new torch
tensors (``_allocator``) or of a given one (``into``). The only copy made here is for a non-contiguous
tensor (``_contiguous``).
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from aiacc.compression import bfloat16_dtype
from aiacc.tensors import check_dtype

__all__ = ["to_numpy", "from_array", "flat", "into"]


def to_numpy(tensor: torch.Tensor, name: Optional[str]):
    """A writeable view of ``tensor``'s memory (no copy): numpy for CPU tensors, cupy (through
    DLPack) for CUDA tensors, which the engine then reduces with NCCL."""
    label = name or "(unnamed)"
    _check_tensor(tensor, name)
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
    except (TypeError, RuntimeError):  # a dtype numpy does not have: the core's error
        if t.is_conj() or t.is_neg():  # a lazy conjugate view (x.conj()): a copy of its values (in place: _resolved)
            return _resolved(t).numpy()
        check_dtype(None, label, shown=str(t.dtype).replace("torch.", ""))


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


def _contiguous(tensor: torch.Tensor, name: Optional[str] = None) -> torch.Tensor:
    _check_tensor(tensor, name)
    if tensor.layout != torch.strided:
        to_numpy(tensor, name)  # raises what aiacc communicates instead (``contiguous()`` would only fail)
    t = tensor.detach() if tensor.requires_grad else tensor
    return t if t.is_contiguous() else t.contiguous()


def _resolved(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in memory of their own where ``t`` is a lazy conjugate (or negated) view, which numpy cannot
    view (``x.conj()``, ``x.conj().imag``): an in-place operation stages it and copies the result back; else ``t``."""
    return t.resolve_conj().resolve_neg() if t.is_conj() or t.is_neg() else t


def _check_tensor(tensor, name: Optional[str]) -> None:
    """A TypeError naming the tensor unless ``tensor`` is a torch.Tensor (a ``.grad`` still None, say)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor {name or '(unnamed)'!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_nested:  # (of a dtype aiacc has: the dtype's error said float32 was not supported)
        raise ValueError(f"tensor {name or '(unnamed)'!r} is a nested tensor; aiacc communicates dense tensors (each "
                         "component on its own: t.unbind(), or padded: t.to_padded_tensor(0))")


def _refuse(tensors, name: Optional[str]) -> None:
    """Raise the TypeError of the first member of ``tensors`` that is not a torch.Tensor."""
    for t in tensors:
        _check_tensor(t, name)


def _in_place_array(t):
    """``t``'s own memory as a numpy array where the engine can reduce it there (a contiguous host tensor
    that needs no grad), else None: ``to_numpy`` then handles or explains it."""
    try:
        return t.numpy() if t.is_contiguous() and not t.requires_grad else None
    except (TypeError, RuntimeError, AttributeError):
        return None


# name -> (data_ptr, shape, dtype, array): the numpy view of the tensor last reduced in place under a name.
# ``Tensor.numpy()`` costs ~0.5 us, about a third of a small tensor's whole submit; the checks that the tensor
# still is that memory, with that shape and dtype (the view keeps the memory alive, so no other tensor can
# hold that address meanwhile) cost ~0.2. Only small tensors (where that matters) are remembered, at most
# _VIEWS_MAX of them, so a name whose tensor is replaced every step keeps at most one old one alive.
_VIEWS: dict = {}
_VIEWS_MAX = 2048
_VIEW_MAX_BYTES = 64 << 10


def _view_of(t, name: str):
    """``_in_place_array(t)``, remembered under ``name`` for a small tensor (``allreduce_async_`` checks a
    remembered one: the same address, dtype and shape, and contiguous)."""
    array = _in_place_array(t)
    if array is not None and array.nbytes <= _VIEW_MAX_BYTES and array.dtype.kind != "c":  # (x.conj(): x's address)
        if len(_VIEWS) >= _VIEWS_MAX:
            _VIEWS.clear()
        _VIEWS[name] = (t.data_ptr(), t.shape, t.dtype, array)
    return array


# name -> (key, arrays): the numpy views of the group last reduced in place under a name (``grouped_allreduce_``
# of the same tensors every step), ``_VIEWS``'s idea for a group: the key, each tensor's address, shape and dtype
# (only contiguous tensors that need no grad have one), costs ~0.3 us a tensor where ``numpy()`` costs ~1.
_GROUPS: dict = {}
_GROUPS_MAX = 256


def _group_views(tensors, name: str):
    """(the remembered arrays of this group or None, its key); the key is None where some tensor is not
    contiguous or needs grad (not reduced where it lies)."""
    key = [(t.data_ptr(), t.shape, t.dtype) for t in tensors if t.is_contiguous() and not t.requires_grad]
    if len(key) != len(tensors):
        return None, None
    held = _GROUPS.get(name)
    return (held[1] if held is not None and held[0] == key else None), key


def _remember_group(name: str, key, arrays) -> None:
    """Remember a group's numpy views (of small tensors only: the views keep their memory alive)."""
    if all(a.nbytes <= _VIEW_MAX_BYTES and a.dtype.kind != "c" for a in arrays):  # (x.conj(): x's address)
        if len(_GROUPS) >= _GROUPS_MAX:
            _GROUPS.clear()
        _GROUPS[name] = (key, arrays)


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s elements as a 1-D tensor (detached; a copy only where it is not contiguous)."""
    t = tensor.detach()
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)


def into(target: torch.Tensor):
    """An ``allocate`` for the engine that hands it ``target``'s memory (a contiguous CPU tensor of the
    right size), so the result lands there without a copy; anything else gets new memory."""
    def allocate(shape, _dtype):
        count = int(np.prod(shape)) if len(shape) else 1
        if target.is_contiguous() and target.device.type == "cpu" and target.numel() == count:
            return to_numpy(target.detach(), None).reshape(tuple(shape))
        return to_numpy(torch.empty(tuple(shape), dtype=target.dtype, device=target.device), None)
    return allocate


def memory_order(tensor: torch.Tensor) -> Optional[tuple]:
    """The order of ``tensor``'s dimensions in memory, outermost first, when it is dense but not
    row-major (channels_last, a transposed weight); None when row-major, or not dense (with gaps or
    overlaps: its gradient gets row-major memory then, as in DDP)."""
    if tensor.dim() < 2 or tensor.is_contiguous():
        return None
    order = tuple(sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d)))  # (stable: ties keep their order)
    return order if tensor.permute(order).is_contiguous() else None


def laid_out_as(memory: torch.Tensor, order: Optional[tuple], inverse: bool = False) -> torch.Tensor:
    """``memory`` (row-major, its dimensions in ``order``) seen with the dimensions of the tensor whose
    ``memory_order`` is ``order``: the same strides as that tensor. ``inverse``: the other way, a tensor
    of that layout seen with its dimensions in memory order (row-major)."""
    if order is None:
        return memory
    return memory.permute(order if inverse else tuple(order.index(d) for d in range(len(order))))
