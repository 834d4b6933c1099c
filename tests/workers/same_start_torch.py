"""A torch job whose ranks may start from different parameters (manual_seed(rank), no broadcast), for the check of
``DistributedOptimizer`` at its second step. Prints, per rank, the check's warnings (``WARNED``) and the number of
collectives each step ran (``COUNTS``), then ``OK rank=<r>``.

argv: broadcast (0/1), op (average/sum/adasum), backward passes per step, overlap_forward (0/1), process set ranks
(comma-separated, or 'all'); rank 1 starts from another seed, every other rank from seed 0."""

import sys
import warnings

import torch

import aiacc.torch as hvd
from report import report_same_start

broadcast, op, passes, overlap, members = sys.argv[1] == "1", sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", \
    sys.argv[5]
hvd.init()
rank = hvd.rank()
process_set = None if members == "all" else hvd.add_process_set([int(r) for r in members.split(",")])
torch.manual_seed(1 if rank == 1 else 0)
model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
if broadcast:
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), backward_passes_per_step=passes,
                               op={"average": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum}[op],
                               overlap_forward=overlap, process_set=process_set)
if broadcast:
    hvd.broadcast_optimizer_state(opt, root_rank=0)


def collectives() -> int:
    s = hvd.summary()
    return sum(s[k] for k in ("allreduce_requests", "allgather", "broadcast", "alltoall", "reducescatter", "barrier",
                              "adasum"))


torch.manual_seed(100 + rank)
counts = []
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    for step in range(6):
        opt.zero_grad()
        for _ in range(passes):
            model(torch.randn(8, 4)).square().sum().backward()
        opt.step()
        counts.append(collectives())
    if overlap:
        opt.synchronize()
# one write per rank (the ranks' lines would interleave)
report_same_start(rank, seen, counts)
