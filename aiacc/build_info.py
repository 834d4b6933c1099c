"""What aiacc was built with, in the words of Horovod's ``*_built()`` / ``*_enabled()`` queries.

Facts about the core's transports, the same for every framework: aiacc always
communicates through MPI (mpi4py), never through Gloo, oneCCL, IBM DDL or
ROCm. Whether a framework's GPU tensors go over NCCL depends on the adapter
(``aiacc.torch.nccl_built``), so NCCL and CUDA are not answered here.
"""

from __future__ import annotations

__all__ = ["mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "ccl_built", "ddl_built", "rocm_built"]


def mpi_built() -> bool:
    """True: aiacc always communicates through MPI (mpi4py)."""
    return True


def mpi_enabled() -> bool:
    """Whether MPI runs in this process: the engine is on (``AIACC_ENABLE``; after ``init``, whether it started)."""
    from .api import is_enabled  # noqa: PLC0415 - keeps this module free of the engine's imports

    return is_enabled()


def gloo_built() -> bool:
    """False: aiacc has no Gloo transport."""
    return False


def gloo_enabled() -> bool:
    return False


def ccl_built() -> bool:
    """False: aiacc has no oneCCL transport."""
    return False


def ddl_built() -> bool:
    """False: aiacc has no IBM DDL transport."""
    return False


def rocm_built() -> bool:
    """False: aiacc reduces no ROCm tensors."""
    return False
