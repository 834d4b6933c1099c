"""aiacc.torch switched off (AIACC_ENABLE unset or 0): the user's own optimizer (its arguments still
checked), and broadcasts and collectives that behave as in a job of one rank, autograd still flowing;
MPI never starts."""

import sys
import warnings

import torch

import aiacc.torch as hvd
from report import raises, say

hvd.init()
assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (0, 1, 0, 1)
assert not hvd.is_enabled()

torch.manual_seed(0)
model = torch.nn.Linear(3, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
assert hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                compression=hvd.Compression.fp16, backward_passes_per_step=2) is opt
# the wrapper's argument checks run switched off too: a mistake shows before the script is launched
raises(ValueError, lambda: hvd.DistributedOptimizer(opt, backward_passes_per_step=0), "backward_passes_per_step=0")
# (1.5 was taken as 1, '2' was a TypeError about '<')
for passes in (1.5, "2"):
    raises(ValueError, lambda: hvd.DistributedOptimizer(opt, backward_passes_per_step=passes),
           f"backward_passes_per_step={passes!r} must be a whole number >= 1")
raises(ValueError, lambda: hvd.DistributedOptimizer(opt, op=hvd.Min), "op=Min is not supported for gradients")
# (NaN and inf were taken, and the first step named a bucket's prescale_factor)
for factor in (float("nan"), float("inf"), 0.0):
    raises(ValueError, lambda: hvd.DistributedOptimizer(opt, gradient_predivide_factor=factor),
           f"gradient_predivide_factor={factor!r} must be a finite number > 0")
raises(ValueError, lambda: hvd.DistributedOptimizer(opt, compression="fp8"), "compression='fp8' is not supported")
raises(ValueError, lambda: hvd.DistributedOptimizer(opt, named_parameters=[("w", model.weight), ("w", model.bias)]),
       "duplicate parameter name 'w'")
raises(ValueError, lambda: hvd.DistributedOptimizer(opt, named_parameters=[("w", model.weight)]),
       "named_parameters does not cover parameters of the optimizer")
# a torch.compile'd model: no warning that communication cannot overlap backward, where nothing communicates
compiled = torch.compile(torch.nn.Linear(3, 2))
with warnings.catch_warnings(record=True) as warned:
    warnings.simplefilter("always")
    copt = torch.optim.SGD(compiled.parameters(), lr=0.1)
    assert hvd.DistributedOptimizer(copt, named_parameters=compiled.named_parameters()) is copt
assert not [w for w in warned if "cannot overlap backward" in str(w.message)], [str(w.message) for w in warned]
before = {k: v.clone() for k, v in model.state_dict().items()}
# a job of one rank: root 3 does not exist
raises(ValueError, lambda: hvd.broadcast_parameters(model.state_dict(), root_rank=3),
       "root_rank=3 is out of range for a job of 1 rank (valid: 0..0)")
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
model(torch.ones(4, 3)).sum().backward()
opt.step()
state = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
raises(ValueError, lambda: hvd.broadcast_optimizer_state(opt, root_rank=3), "root_rank=3 is out of range")
hvd.broadcast_optimizer_state(opt, root_rank=0)
assert all(torch.equal(v, opt.state_dict()["state"][0][k]) for k, v in state.items())
assert not torch.equal(before["weight"], model.weight)  # the plain optimizer stepped

x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
assert torch.equal(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0), x * 2)  # as on one rank: scaled
for fn in (lambda: hvd.allreduce(x, op=hvd.Sum), lambda: hvd.allgather(x), lambda: hvd.broadcast(x, 0),
           lambda: hvd.reducescatter(x), lambda: hvd.alltoall(x), lambda: hvd.synchronize(hvd.allreduce_async(x))):
    out = fn()
    assert torch.equal(out, x) and out is not x, out
y = x.clone()
assert hvd.allreduce_(y) is y and torch.equal(y, x)
assert hvd.broadcast_(y, 0) is y
out, splits = hvd.alltoall(x, splits=[2])
assert torch.equal(out, x) and splits.tolist() == [2]
assert [t.tolist() for t in hvd.grouped_allreduce([x, x])] == [x.tolist(), x.tolist()]
assert torch.equal(hvd.allreduce(x.bfloat16()), x.bfloat16())
w = torch.ones(2, 3, requires_grad=True)
(hvd.allreduce(w) * 3).sum().backward()
assert torch.equal(w.grad, torch.full((2, 3), 3.0)), w.grad
assert hvd.broadcast_object({"a": 1}) == {"a": 1} and hvd.allgather_object(5) == [5]
hvd.barrier()
assert hvd.join() == 0
assert "mpi4py.MPI" not in sys.modules, "MPI was started although aiacc is disabled"
hvd.shutdown()
say("OK rank=0")
