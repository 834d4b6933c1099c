#!/bin/bash
# The GPU issue's prepared device check, for a machine with a CUDA GPU whose python3 already holds
# torch and cupy (this project's lent device image) but nothing from PyPI can be installed.
#
#   bash tools/gpu_device_check.sh [OUTDIR]        # from the repository root
#
# MPI comes from the mpich and mpi4py wheels in .whl/ (downloaded beforehand for the machine's
# Python, see the README's GPU section); aiacc runs from the checkout (PYTHONPATH, with the
# adapters linked in as an install would place them). Steps: versions, tests/gpu under pytest,
# tests/gpu/device_check.py on one rank, the allreduce benchmark on device memory (engine vs raw
# NCCL, 1 MiB to 256 MiB), and two ranks on one GPU (NCCL refuses duplicate GPUs in one
# communicator: this step records what a user sees then); with HOROVOD=<a Horovod checkout> (whose
# parent folder also holds the mock and parameterized wheels) Horovod's test_torch.py on one rank.
# Every step runs; the log goes to OUTDIR.
set -u
out=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$out"
exec > >(tee "$out/gpu_check.log") 2>&1
python3 -m venv /tmp/aiacc-venv || exit 1
# python3 may itself be a virtual environment (the device image's is): see its packages through a .pth
# file, placed after the new environment's own site-packages so that the carried mpi4py wins
python3 -c "import site; print('\n'.join(site.getsitepackages()))" \
    > "$(/tmp/aiacc-venv/bin/python -c 'import site; print(site.getsitepackages()[0])')/base-python.pth"
/tmp/aiacc-venv/bin/python -m pip install -q --no-index --no-deps --no-compile .whl/*.whl || exit 1
for f in torch tensorflow keras mxnet; do ln -sfn "../adapters/$f" "aiacc/$f"; done
ln -sfn ../bench aiacc/bench
export PYTHONPATH=$PWD PATH=/tmp/aiacc-venv/bin:$PATH OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1
py=/tmp/aiacc-venv/bin/python
step() {
    local name=$1 limit=$2
    shift 2
    echo "=== $name"
    local t0=$SECONDS
    timeout "$limit" "$@"
    echo "=== $name rc=$? (${SECONDS}s total, $((SECONDS - t0))s for this step)"
}
step versions 60 $py -c "
import numpy, torch, cupy, mpi4py
from cupy.cuda import nccl
from mpi4py import MPI
print('numpy', numpy.__version__, 'torch', torch.__version__, 'cupy', cupy.__version__, 'nccl', nccl.get_version(),
      'mpi4py', mpi4py.__version__, MPI.Get_library_version().splitlines()[0])
print('gpu', torch.cuda.get_device_name(0), 'count', torch.cuda.device_count())"
step pytest_gpu 240 $py -m pytest -q -p no:cacheprovider tests/gpu
step device_check 240 $py -m aiacc.launcher -np 1 $py tests/gpu/device_check.py
AIACC_HIERARCHICAL_ALLREDUCE=1 step device_check_hierarchical 240 $py -m aiacc.launcher -np 1 $py tests/gpu/device_check.py
step bench_cuda 180 $py -m aiacc.launcher -np 1 $py -m aiacc.bench allreduce --device cuda \
    --min-bytes 1MiB --max-bytes 256MiB --factor 4 --repeats 5
step two_ranks_one_gpu 90 $py -m aiacc.launcher -np 2 $py tests/workers/gpu_collectives.py
if [ -n "${HOROVOD:-}" ]; then  # a Horovod checkout (HOROVOD=path): its test_torch.py on one rank, CUDA cases included
    $py -m pip install -q --no-index --no-deps --no-compile "$HOROVOD"/../*.whl 2>/dev/null  # mock, parameterized
    printf '#!/bin/sh\nexec %s -m aiacc.launcher "$@"\n' "$py" > /tmp/aiacc-venv/bin/aiaccrun
    chmod +x /tmp/aiacc-venv/bin/aiaccrun
    step horovod_test_torch 300 $py tools/horovod_suites.py --horovod "$HOROVOD" torch --np 1 --test-timeout 60 \
        --suite-timeout 240 --json "$out/horovod_torch_gpu.json"
fi
echo "=== done in ${SECONDS}s"
