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


def test_two_ranks_on_one_gpu_are_refused_with_the_ranks_and_the_gpu_named():
    """NCCL cannot put two ranks of one communicator on one GPU; the job must end saying so, not hang
    or end with NCCL's bare 'invalid usage'. Runs where the host has one GPU (a rank per GPU elsewhere)."""
    if cupy.cuda.runtime.getDeviceCount() != 1:
        pytest.skip("the host has several GPUs: every rank gets its own")
    job = aiaccrun(2, "gpu_collectives.py", timeout=120)
    assert job.returncode != 0, job.output
    assert "ranks 0 and 1 both use CUDA device" in job.output and "GPU of its own for every rank" in job.output, \
        job.output
