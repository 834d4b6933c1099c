"""Transports: real communication engines only. ``mpi`` (mpi4py) carries host
arrays; ``nccl`` carries CUDA arrays."""
