#!/usr/bin/env bash
# Builds Horovod 0.28.1 (its PyTorch adapter, MPI from the mpich wheel) into the current venv, as a
# benchmark baseline only: aiacc never imports it. Horovod is no longer released and does not build
# against current torch as shipped; three changes make it build here, and this script makes them to a
# fresh copy of the sdist it downloads (nothing of Horovod is kept in this repository):
#   * C++17 instead of C++14 in CMakeLists.txt and horovod/torch/CMakeLists.txt (torch 2.x headers
#     need C++17);
#   * CMAKE_POLICY_VERSION_MINIMUM=3.5 (its third-party CMake files predate CMake 4's minimum);
#   * TensorFlow, MXNet and Gloo left out (HOROVOD_WITHOUT_*).
# Usage: tools/build_horovod.sh [VENV]   (default .venv; takes ~10-20 min on 2 cores)
# Afterwards `python -m aiacc.bench train --framework torch` adds a `horovod` row.
set -euo pipefail
venv=${1:-.venv}
py="$venv/bin/python"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" -m pip download --quiet --no-deps --no-binary :all: horovod==0.28.1 -d "$work"
tar xzf "$work"/horovod-0.28.1.tar.gz -C "$work"
src="$work/horovod-0.28.1"
sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
export PATH="$(cd "$venv/bin" && pwd):$PATH"   # mpicxx and mpiexec of the mpich wheel
export CMAKE_POLICY_VERSION_MINIMUM=3.5 HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 \
       HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_GLOO=1 \
       HOROVOD_CPU_OPERATIONS=MPI MAKEFLAGS="-j$(nproc)"
"$py" -m pip install --quiet cffi cloudpickle psutil pyyaml packaging   # what Horovod imports at run time
"$py" -m pip install --quiet --no-build-isolation --no-deps "$src"
"$py" -c "import horovod.torch as hvd; print('horovod', hvd.__version__ if hasattr(hvd, '__version__') else '0.28.1', 'built: mpi', hvd.mpi_built())"
