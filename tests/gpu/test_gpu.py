"""GPU path (NCCL transport, device fusion). Skipped, with the reason shown, where no CUDA GPU is usable."""

import pytest

from aiacc.transport.nccl import cupy_or_none
from conftest import aiaccrun, assert_ok

cupy = cupy_or_none()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(cupy is None, reason="no usable CUDA GPU: cupy (pip install 'aiacc[gpu]') "
                                            "is missing or finds no device"),
]


def test_cuda_arrays_reduce_over_nccl_like_host_arrays_over_mpi():
    n = min(2, cupy.cuda.runtime.getDeviceCount()) if cupy is not None else 1
    job = aiaccrun(n, "gpu_collectives.py", timeout=300)
    assert_ok(job, n)
