"""``hvd.Compression`` for MXNet (Horovod's ``horovod.mxnet.compression``): the core's compressors (the engine
casts on the wire by itself; ``compress`` / ``decompress`` also take NDArrays), and Horovod's names: its base
class of compressors of one's own, which MXNet's ``compression=`` refuses by name (see
``aiacc.compression.CustomCompressor``), and the built-in ones."""

from __future__ import annotations

from aiacc.compression import Compression, CustomCompressor

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor"]

Compressor = CustomCompressor
NoneCompressor, FP16Compressor, BF16Compressor = Compression.none, Compression.fp16, Compression.bf16
