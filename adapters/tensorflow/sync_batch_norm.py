"""Horovod's ``horovod.tensorflow.sync_batch_norm`` path: the Keras layer of :mod:`aiacc.keras` (Keras loads here)."""

from .keras._sync_bn import SyncBatchNormalization

__all__ = ["SyncBatchNormalization"]
