"""Horovod's ``horovod.mxnet.functions`` path: the object collectives of :mod:`aiacc.mxnet` (any picklable object)."""

from aiacc import allgather_object, broadcast_object

__all__ = ["broadcast_object", "allgather_object"]
