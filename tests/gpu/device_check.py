"""Short device check of the GPU path, for a machine with one CUDA GPU (a few minutes at most).

    pip install -e '.[torch,gpu]' && aiaccrun -np 1 python tests/gpu/device_check.py

Checks, each printing PASS or FAIL with the reason (every check runs even when one before it failed;
the exit status is 1 when any failed):
  1. NCCL allreduce / allgather / broadcast / alltoall / reducescatter of cupy arrays equal the same
     operations on host arrays (which go over MPI);
  2. device fusion: many small CUDA arrays fused on the device give the host path's results;
  3. fp16 compression cast on the device, within fp16's precision of the exact result;
  4. a small PyTorch training step on CUDA through DistributedOptimizer equals the plain optimizer;
  5. the same training through DistributedOptimizer on CUDA equals it on CPU, within float tolerance;
  6. the torch adapter's collectives on CUDA tensors (in-place and grouped allreduce, allgather,
     broadcast_parameters, fp16 compression in DistributedOptimizer) equal their CPU results;
  7. torch.distributed on the ``aiacc`` backend with CUDA tensors: all_reduce and a DDP step;
  8. Adasum of a CUDA array is refused with a TypeError that says to reduce a CPU copy (Adasum runs on
     host arrays only, as its exchanges go over MPI);
and prints the bus bandwidth of a 256 MiB allreduce through the engine beside raw NCCL.
"""

import time
import traceback

import cupy as cp
import numpy as np

import aiacc
from aiacc.transport.nccl import cupy_or_none

assert cupy_or_none() is not None, "no usable CUDA GPU"
aiacc.init()
n = aiacc.size()
rng = np.random.default_rng(0)
failed = []


def check(number, title):
    def run(fn):
        try:
            fn()
            print(f"PASS {number} {title}", flush=True)
        except Exception:  # noqa: BLE001 - report every failing check, then go on
            failed.append(number)
            print(f"FAIL {number} {title}\n{traceback.format_exc()}", flush=True)
        return fn
    return run


def same(dev, host, tol=1e-6, what=""):
    got = cp.asnumpy(dev)
    np.testing.assert_allclose(got, host, rtol=tol, atol=tol, err_msg=what)


@check(1, "NCCL collectives equal the host path")
def _():
    x = rng.random((1000, 3)).astype(np.float32)
    same(aiacc.allreduce(cp.asarray(x), op=aiacc.Sum, name="d.ar"), aiacc.allreduce(x, op=aiacc.Sum, name="h.ar"),
         what="allreduce")
    same(aiacc.allgather(cp.asarray(x), name="d.ag"), aiacc.allgather(x, name="h.ag"), what="allgather")
    same(aiacc.broadcast(cp.asarray(x), 0, name="d.bc"), aiacc.broadcast(x, 0, name="h.bc"), what="broadcast")
    same(aiacc.alltoall(cp.asarray(x[: 10 * n]), name="d.a2a"), aiacc.alltoall(x[: 10 * n], name="h.a2a"),
         what="alltoall")
    same(aiacc.reducescatter(cp.asarray(x), op=aiacc.Sum, name="d.rs"),
         aiacc.reducescatter(x, op=aiacc.Sum, name="h.rs"), what="reducescatter")
    y = cp.asarray(x)
    assert aiacc.allreduce_(y, op=aiacc.Sum, name="d.inplace") is y, "allreduce_ did not return its input"
    same(y, aiacc.allreduce(x, op=aiacc.Sum, name="h.inplace"), what="allreduce_")
    assert aiacc.get_engine()._nccl is not None, "CUDA arrays did not go through NCCL"


@check(2, "device fusion of 200 small arrays")
def _():
    small = [rng.random(257).astype(np.float32) for _ in range(200)]
    dev_handles = [aiacc.allreduce_async(cp.asarray(s), name=f"d.small.{i}") for i, s in enumerate(small)]
    host_handles = [aiacc.allreduce_async(s, name=f"h.small.{i}") for i, s in enumerate(small)]
    for d, h in zip(dev_handles, host_handles):
        same(aiacc.synchronize(d), aiacc.synchronize(h), what="fused")
    grouped = aiacc.grouped_allreduce([cp.asarray(s) for s in small], name="d.grouped")
    for g, s in zip(grouped, small):
        same(g, s, what="grouped")


@check(3, "fp16 compression on the device")
def _():
    g = rng.random(100_000).astype(np.float32)
    out = aiacc.allreduce(cp.asarray(g), name="d.fp16", compression=aiacc.Compression.fp16)
    assert out.dtype == cp.float32, out.dtype
    same(out, g, tol=2e-3, what="fp16")


import torch  # noqa: E402

import aiacc.torch as hvd  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False  # CPU and CUDA results comparable to float32 precision


def train(device, distributed, steps=3, compression=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if distributed:
        kwargs = {} if compression is None else {"compression": compression}
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kwargs)
    g = torch.Generator().manual_seed(1)
    xb, yb = torch.randn(32, 64, generator=g).to(device), torch.randint(0, 10, (32,), generator=g).to(device)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


@check(4, "PyTorch CUDA step through DistributedOptimizer equals the plain optimizer")
def _():
    for a, b in zip(train("cuda", False), train("cuda", True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # one rank: the average is the gradient itself


@check(5, "DistributedOptimizer on CUDA equals it on CPU")
def _():
    for a, b in zip(train("cpu", True), train("cuda", True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@check(6, "torch adapter collectives on CUDA tensors equal CPU")
def _():
    t = torch.randn(50, 7)
    c = t.cuda()
    assert hvd.allreduce_(c, op=hvd.Sum, name="t.inplace") is c
    torch.testing.assert_close(c.cpu(), hvd.allreduce(t, op=hvd.Sum, name="t.inplace.cpu"))
    out = hvd.grouped_allreduce([t.cuda(), (2 * t).cuda()], op=hvd.Sum, name="t.grouped")
    assert all(o.is_cuda for o in out), [o.device for o in out]
    torch.testing.assert_close(out[1].cpu(), 2 * t)
    gathered = hvd.allgather(c, name="t.ag")
    assert gathered.is_cuda and gathered.shape == (50 * n, 7), (gathered.device, gathered.shape)
    model = torch.nn.Linear(5, 3).cuda()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for a, b in zip(train("cpu", True, compression=hvd.Compression.fp16),
                    train("cuda", True, compression=hvd.Compression.fp16)):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)


@check(7, "torch.distributed 'aiacc' backend on CUDA tensors")
def _():
    import torch.distributed as dist  # noqa: PLC0415

    dist.init_process_group("aiacc")
    t = torch.arange(12, dtype=torch.float32, device="cuda")
    dist.all_reduce(t)
    torch.testing.assert_close(t.cpu(), torch.arange(12, dtype=torch.float32) * n)
    torch.manual_seed(0)
    plain = torch.nn.Linear(16, 4).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4).cuda())
    ddp.module.load_state_dict(plain.state_dict())
    x = torch.randn(8, 16, device="cuda")
    for m in (plain, ddp):
        m(x).square().sum().backward()
    for a, b in zip(plain.parameters(), ddp.module.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    dist.destroy_process_group()


@check(8, "Adasum of CUDA arrays is refused, naming the tensor and saying what to do")
def _():
    try:
        aiacc.allreduce(cp.asarray(rng.random(8)), op=aiacc.Adasum, name="d.adasum")
    except TypeError as exc:
        assert "Adasum" in str(exc) and "a CUDA array" in str(exc) and "reduce a CPU copy" in str(exc), exc
    else:
        raise AssertionError("Adasum of a CUDA array was not refused")


def timed(fn, iters=10):
    fn()
    cp.cuda.Stream.null.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    cp.cuda.Stream.null.synchronize()
    return (time.perf_counter() - start) / iters


try:
    buf = cp.ones(64 << 20, cp.float32)
    nccl = aiacc.get_engine()._nccl
    raw = timed(lambda: nccl.allreduce(None, buf, aiacc.Sum))
    eng = timed(lambda: aiacc.allreduce_(buf, op=aiacc.Sum, name="bw"))
    factor = 2 * (n - 1) / n if n > 1 else 1.0
    print(f"256 MiB allreduce on {n} GPU(s): raw NCCL {raw * 1e3:.2f} ms ({buf.nbytes / raw * factor / 1e9:.1f} GB/s), "
          f"aiacc {eng * 1e3:.2f} ms ({buf.nbytes / eng * factor / 1e9:.1f} GB/s); "
          "busbw = bytes/time x 2(n-1)/n (x1 on one rank: a local reduction)", flush=True)
except Exception:  # noqa: BLE001
    failed.append("bandwidth")
    print(f"FAIL bandwidth\n{traceback.format_exc()}", flush=True)
aiacc.shutdown()
print("DEVICE CHECK OK" if not failed else f"DEVICE CHECK FAILED: {failed}", flush=True)
raise SystemExit(1 if failed else 0)
