"""DDP on the aiacc backend: rank 1 exits with the status given on the command line at step 3 while the other
ranks train (their backward waits for its allreduce). DDP's reducer reads the error from the Work's future.
With 'raise' instead of a status, rank 1 raises an exception nobody catches."""

import sys

import torch
import torch.distributed as dist

import aiacc.torch  # noqa: F401 - registers the backend

dist.init_process_group("aiacc")
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(10, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(10):
    if dist.get_rank() == 1 and step == 3:
        if sys.argv[1] == "raise":
            raise ValueError("rank 1: batch 3 of data.csv is corrupt")
        sys.exit(int(sys.argv[1]))
    opt.zero_grad()
    model(torch.randn(4, 10)).sum().backward()
    opt.step()
raise AssertionError("training went on without rank 1")
