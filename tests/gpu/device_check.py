"""Short device check of the GPU path, for a machine with one CUDA GPU (a few minutes at most).

    pip install -e '.[torch,gpu]' && aiaccrun -np 1 python tests/gpu/device_check.py

Checks, each printing PASS or raising:
  1. NCCL allreduce / allgather / broadcast / alltoall / reducescatter of cupy arrays equal the same
     operations on host arrays (which go over MPI);
  2. device fusion: many small CUDA tensors fused on the device give the host path's results;
  3. fp16 compression cast on the device, within fp16's precision of the exact result;
  4. a small PyTorch training step on CUDA through DistributedOptimizer equals the plain optimizer;
and prints the bus bandwidth of a 256 MiB allreduce through the engine beside raw NCCL.
"""

import time

import cupy as cp
import numpy as np

import aiacc
from aiacc.transport.nccl import cupy_or_none

assert cupy_or_none() is not None, "no usable CUDA GPU"
aiacc.init()
n = aiacc.size()
rng = np.random.default_rng(0)


def same(dev, host, tol=1e-6, what=""):
    got = cp.asnumpy(dev)
    np.testing.assert_allclose(got, host, rtol=tol, atol=tol, err_msg=what)


# 1. every collective on the device equals the host path
x = rng.random((1000, 3)).astype(np.float32)
same(aiacc.allreduce(cp.asarray(x), op=aiacc.Sum, name="d.ar"), aiacc.allreduce(x, op=aiacc.Sum, name="h.ar"), what="allreduce")
same(aiacc.allgather(cp.asarray(x), name="d.ag"), aiacc.allgather(x, name="h.ag"), what="allgather")
same(aiacc.broadcast(cp.asarray(x), 0, name="d.bc"), aiacc.broadcast(x, 0, name="h.bc"), what="broadcast")
same(aiacc.alltoall(cp.asarray(x[: 10 * n]), name="d.a2a"), aiacc.alltoall(x[: 10 * n], name="h.a2a"), what="alltoall")
same(aiacc.reducescatter(cp.asarray(x), op=aiacc.Sum, name="d.rs"), aiacc.reducescatter(x, op=aiacc.Sum, name="h.rs"),
     what="reducescatter")
assert aiacc.get_engine()._nccl is not None, "CUDA arrays did not go through NCCL"
print("PASS 1 NCCL collectives equal the host path", flush=True)

# 2. device fusion: 200 small tensors submitted together are fused on the device
small = [rng.random(257).astype(np.float32) for _ in range(200)]
dev_handles = [aiacc.allreduce_async(cp.asarray(s), name=f"d.small.{i}") for i, s in enumerate(small)]
host_handles = [aiacc.allreduce_async(s, name=f"h.small.{i}") for i, s in enumerate(small)]
for d, h in zip(dev_handles, host_handles):
    same(aiacc.synchronize(d), aiacc.synchronize(h), what="fused")
print(f"PASS 2 device fusion ({aiacc.get_engine().stats['allreduces']} allreduces so far)", flush=True)

# 3. fp16 compression on the device
g = rng.random(100_000).astype(np.float32)
same(aiacc.allreduce(cp.asarray(g), name="d.fp16", compression=aiacc.Compression.fp16), g, tol=2e-3, what="fp16")
print("PASS 3 fp16 compression on the device", flush=True)

# 4. a PyTorch training step on CUDA through DistributedOptimizer
import torch  # noqa: E402

import aiacc.torch as hvd  # noqa: E402

torch.manual_seed(0)
models = [torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).cuda()
          for _ in range(2)]
models[1].load_state_dict(models[0].state_dict())
plain = torch.optim.SGD(models[0].parameters(), lr=0.1, momentum=0.9)
dist = hvd.DistributedOptimizer(torch.optim.SGD(models[1].parameters(), lr=0.1, momentum=0.9),
                                named_parameters=models[1].named_parameters())
xb, yb = torch.randn(32, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
for m, opt in zip(models, (plain, dist)):
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(xb), yb).backward()
        opt.step()
for a, b in zip(models[0].parameters(), models[1].parameters()):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # one rank: the average is the gradient itself
print("PASS 4 PyTorch CUDA step through DistributedOptimizer", flush=True)

# bus bandwidth of a 256 MiB buffer: engine vs raw NCCL on the same communicator
buf = cp.ones(64 << 20, cp.float32)
nccl = aiacc.get_engine()._nccl


def timed(fn, iters=10):
    fn()
    cp.cuda.Stream.null.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    cp.cuda.Stream.null.synchronize()
    return (time.perf_counter() - start) / iters


raw = timed(lambda: nccl.allreduce(None, buf, aiacc.Sum))
eng = timed(lambda: aiacc.submit(aiacc.Collective.ALLREDUCE, buf, name="bw", op=aiacc.Sum, outputs=[buf]).wait())
factor = 2 * (n - 1) / n if n > 1 else 1.0
print(f"256 MiB allreduce on {n} GPU(s): raw NCCL {raw * 1e3:.2f} ms ({buf.nbytes / raw * factor / 1e9:.1f} GB/s busbw), "
      f"aiacc {eng * 1e3:.2f} ms ({buf.nbytes / eng * factor / 1e9:.1f} GB/s busbw); "
      "busbw = bytes/time x 2(n-1)/n (x1 on one rank: a copy-free local reduction)", flush=True)
aiacc.shutdown()
print("DEVICE CHECK OK", flush=True)
