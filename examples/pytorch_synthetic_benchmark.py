"""Horovod's classic PyTorch synthetic benchmark, on aiacc: only the import is changed.

    aiaccrun -np 2 python examples/pytorch_synthetic_benchmark.py --model cnn --batch-size 32

Models: ``cnn`` and ``transformer`` (the shared benchmark models of ``aiacc.bench.common``), or
any torchvision model name (``resnet50``, ...) where torchvision is installed. Prints img/sec per
rank and in total, as Horovod's script does. CPU only (aiacc.torch communicates CPU tensors).
"""

import argparse
import timeit

import numpy as np
import torch
import torch.nn.functional as F

import aiacc.torch as hvd
from aiacc.bench.train_torch import build_model, synthetic_batch

parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--fp16-allreduce", action="store_true", default=False, help="use fp16 compression during allreduce")
parser.add_argument("--model", type=str, default="cnn", help="cnn, transformer, narrow, or a torchvision model")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
parser.add_argument("--num-warmup-batches", type=int, default=3, help="number of warm-up batches that don't count towards benchmark")
parser.add_argument("--num-batches-per-iter", type=int, default=5, help="number of batches per benchmark iteration")
parser.add_argument("--num-iters", type=int, default=5, help="number of benchmark iterations")
parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
args = parser.parse_args()
for flag in ('batch_size', 'num_batches_per_iter', 'num_iters'):  # (0 divided by zero, or trained nothing and exited 0)
    if getattr(args, flag) < 1:
        parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")

hvd.init()
torch.set_num_threads(args.threads)
torch.manual_seed(0)

if args.model in ("cnn", "transformer", "narrow"):
    model = build_model(args.model)
    data, target = synthetic_batch(args.model, args.batch_size, torch.Generator().manual_seed(hvd.rank()))
else:
    try:
        from torchvision import models  # noqa: PLC0415 - optional
    except ImportError:
        raise SystemExit(f"--model {args.model}: not cnn, transformer or narrow, and torchvision (for its models) is "
                         "not installed") from None
    if not callable(getattr(models, args.model, None)):
        raise SystemExit(f"--model {args.model}: not cnn, transformer, narrow, nor a torchvision model")
    model = getattr(models, args.model)()
    data = torch.randn(args.batch_size, 3, 224, 224)
    target = torch.randint(0, 1000, (args.batch_size,))

optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=compression)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)


def benchmark_step():
    optimizer.zero_grad()
    output = model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    optimizer.step()


def log(s, nl=True):
    if hvd.rank() != 0:
        return
    print(s, end="\n" if nl else "", flush=True)


log(f"Model: {args.model}")
log(f"Batch size: {args.batch_size}")
log(f"Number of CPUs: {hvd.size()}")

log("Running warmup...")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)

log("Running benchmark...")
img_secs = []
for x in range(args.num_iters):
    time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / time
    log(f"Iter #{x}: {img_sec:.1f} img/sec per CPU")
    img_secs.append(img_sec)

img_sec_mean = np.mean(img_secs)
img_sec_conf = 1.96 * np.std(img_secs)
log(f"Img/sec per CPU: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
log(f"Total img/sec on {hvd.size()} CPU(s): {hvd.size() * img_sec_mean:.1f} +-{hvd.size() * img_sec_conf:.1f}")
hvd.shutdown()
