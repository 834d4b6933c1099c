"""What aiacc was built with, in the words of Horovod's ``*_built()`` / ``*_enabled()`` queries.

Facts about the core's transports, the same for every framework: aiacc always
communicates through MPI (mpi4py), never through Gloo, oneCCL, IBM DDL or
ROCm. Whether a framework's GPU tensors go over NCCL depends on the adapter
(``aiacc.torch.nccl_built``), so NCCL and CUDA are not answered here.
"""

from __future__ import annotations

__all__ = ["mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "ccl_built", "ddl_built", "rocm_built",
           "gpu_available"]


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


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Horovod's ``gpu_available('torch' | 'tensorflow' | 'mxnet')``: whether that framework sees a GPU here."""
    import importlib  # noqa: PLC0415

    name = ext_base_name
    if name not in ("torch", "tensorflow", "mxnet"):
        raise ValueError(f"gpu_available: unknown framework {ext_base_name!r}; use 'torch', 'tensorflow' or 'mxnet'")
    try:
        fw = importlib.import_module(name)
        if name == "torch":
            found = bool(fw.cuda.is_available())
        elif name == "tensorflow":
            found = bool(fw.config.list_physical_devices("GPU"))
        else:
            found = fw.context.num_gpus() > 0
    except Exception as exc:  # noqa: BLE001 - not installed, or no driver: no GPU
        if verbose:
            print(f"gpu_available({ext_base_name!r}): {type(exc).__name__}: {exc}")
        return False
    return found
