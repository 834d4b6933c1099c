"""A TorchState holding a DistributedOptimizer of a process set without rank 0 is an error on every rank, naming
the keyword and the set: a state commits and syncs rank 0's copy of all it holds, and a restart gave the set's
ranks rank 0's untrained copy of that model, without a word. An optimizer of a set that holds rank 0 is kept.
Usage (3 ranks): torch_elastic_sets.py"""

import torch

import aiacc.torch as hvd
from report import raises, say

torch.set_num_threads(1)
with_zero, without_zero = hvd.ProcessSet([0, 1]), hvd.ProcessSet([1, 2])
hvd.init(process_sets=[with_zero, without_zero])
r = hvd.rank()
a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
opt_a = hvd.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1), named_parameters=a.named_parameters(prefix="a"),
                                 process_set=with_zero)
opt_b = hvd.DistributedOptimizer(torch.optim.SGD(b.parameters(), lr=0.1), named_parameters=b.named_parameters(prefix="b"),
                                 process_set=without_zero)
words = ("is a DistributedOptimizer of process set [1, 2], which does not hold rank 0", "ranks 1, 2 the untrained copy")
raises(hvd.elastic.ElasticStateError, lambda: hvd.elastic.TorchState(model=a, optimizer=opt_a, b=b, opt_b=opt_b),
       "TorchState: opt_b=", *words)
raises(hvd.elastic.ElasticStateError, lambda: hvd.elastic.TorchState(model=b, optimizer=opt_b), "optimizer=", *words)
state = hvd.elastic.TorchState(model=a, optimizer=opt_a, step=0)
raises(hvd.elastic.ElasticStateError, lambda: setattr(state, "optimizer", opt_b), "optimizer=", *words)
state.commit()
say(f"OK rank={r} checks=4")
