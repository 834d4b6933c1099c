"""``hvd.Compression`` for torch tensors: the core's compressors, with Horovod's ``compress`` /
``decompress`` helpers working on torch tensors.

The engine casts on the wire by itself (the core decides the wire dtype, for every framework
alike); these objects only carry that choice's name to it, and give scripts that call
``Compression.fp16.compress(tensor)`` directly the same rule on a torch tensor.
"""

from __future__ import annotations

import torch

from aiacc import compression as core

from .mpi_ops import to_numpy

__all__ = ["Compression", "Compressor"]

_TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


class Compressor:
    """A core compressor (``name`` is what the engine reads) with torch-tensor helpers."""

    def __init__(self, core_compressor: core.Compressor):
        self.core = core_compressor
        self.name = core_compressor.name

    def compress(self, tensor: torch.Tensor):
        """(the tensor in its wire dtype, its own dtype): floats wider than the wire type are cast."""
        native = to_numpy(torch.empty(0, dtype=tensor.dtype), "compress").dtype
        wire = _TORCH.get(self.core.wire_dtype(native).name, tensor.dtype)
        return (tensor if wire == tensor.dtype else tensor.to(wire)), tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx):
        return tensor if ctx is None or tensor.dtype == ctx else tensor.to(ctx)

    def __repr__(self) -> str:
        return f"Compression.{self.name}"


class Compression:
    """Horovod's ``Compression`` namespace: ``none``, ``fp16`` and ``bf16`` on the wire."""

    none = Compressor(core.Compression.none)
    fp16 = Compressor(core.Compression.fp16)
    bf16 = Compressor(core.Compression.bf16)
