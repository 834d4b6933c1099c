"""DistributedOptimizer(op=Adasum) (Horovod's Adasum optimizer), 2 ranks, against a reference built here.

Each rank trains a small model with SGD + momentum on its own batch. The reference replays both ranks
in this process: from the synchronized parameters, each rank's own optimizer (its own momentum) steps
on its own gradient; the two deltas combine as a' = (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b per
parameter (rank 0's delta as a); every parameter moves to start + that. Three steps; a parameter
without a gradient in a step (the unused head) still ends equal on both ranks. Also: the error of a
gradient computed twice before step(), zero_grad() between backward and step() throwing that step's
gradients away (the momentum as it was), and the engine switched
on for a job of 3 ranks is refused at construction (power of 2 only; checked with a bad size hint); with
compression=fp16 the deltas travel as float16. Parameters trainable only after wrapping (unfrozen, or added with
add_param_group) train too.
"""

import copy

import torch

import aiacc.torch as hvd
from report import raises, say

torch.manual_seed(0)
torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
assert n == 2
checks = 0


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 3)
        self.head = torch.nn.Linear(3, 2)
        self.unused = torch.nn.Linear(2, 2)  # no gradient ever: a zero delta each step

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def adasum(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    ab, aa, bb = a @ b, a @ a, b @ b  # (a zero vector keeps its coefficient 1: no division by zero)
    return (1 - ab / (2 * aa) if aa > 0 else 1.0) * a + (1 - ab / (2 * bb) if bb > 0 else 1.0) * b


base = Net()
model = copy.deepcopy(base)
opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(), op=hvd.Adasum)
assert type(opt) is not torch.optim.SGD and isinstance(opt, torch.optim.SGD)  # wrapped, still an SGD

# the reference: both ranks' models and optimizers, replayed here
ref_models = [copy.deepcopy(base) for _ in range(n)]
ref_opts = [sgd(m) for m in ref_models]
synced = {k: v.detach().clone() for k, v in base.state_dict().items()}
for step in range(3):
    x, y = batch(r, step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    deltas = []
    for k in range(n):
        ref_models[k].load_state_dict(synced)
        ref_opts[k].zero_grad()
        xk, yk = batch(k, step)
        torch.nn.functional.mse_loss(ref_models[k](xk), yk).backward()
        ref_opts[k].step()
        deltas.append({name: p.detach() - synced[name] for name, p in ref_models[k].named_parameters()})
    for name, p in model.named_parameters():
        want = synced[name].double() + adasum(deltas[0][name], deltas[1][name]).reshape(p.shape)
        assert torch.allclose(p.detach().double(), want, rtol=1e-5, atol=1e-6), (step, name, p, want)
        synced[name] = want.float()
        checks += 1
    same = hvd.allgather_object([p.detach().numpy().tobytes() for p in model.parameters()])
    assert same[0] == same[1], f"step {step}: the ranks' parameters differ"
    checks += 1
assert torch.equal(model.unused.weight, base.unused.weight)  # zero deltas: unchanged, and the same on both

# parameters the optimizer takes in after wrapping: ``body`` frozen when wrapped and unfrozen at step 1, ``unused``
# added with add_param_group at step 2 (and used from then on). step() applied the deltas of the parameters trainable
# when wrapped only: those two never trained (as under Horovod), silently; now they train as the others do.
class Grown(Net):
    def forward(self, x, extra=False):
        h = self.head(torch.tanh(self.body(x)))
        return h + self.unused(h) if extra else h


base2 = Grown()
grown = [copy.deepcopy(base2) for _ in range(n + 1)]  # this rank's model, then both ranks' replayed
for m in grown:
    m.body.requires_grad_(False)
opts = [torch.optim.SGD(list(m.body.parameters()) + list(m.head.parameters()), lr=0.1, momentum=0.9) for m in grown]
opts[0] = hvd.DistributedOptimizer(opts[0], named_parameters=grown[0].named_parameters(), op=hvd.Adasum)
synced = {k: v.detach().clone() for k, v in base2.state_dict().items()}
for step in range(4):
    for m, o in zip(grown, opts):
        if step == 1:
            m.body.requires_grad_(True)
        if step == 2:
            o.add_param_group({"params": list(m.unused.parameters()), "lr": 0.05})
    deltas = []
    for k, (m, o) in enumerate(zip(grown, opts)):
        if k > 0:
            m.load_state_dict(synced)
        o.zero_grad()
        xk, yk = batch(r if k == 0 else k - 1, 30 + step)
        torch.nn.functional.mse_loss(m(xk, step >= 2), yk).backward()
        o.step()
        if k > 0:
            deltas.append({name: p.detach() - synced[name] for name, p in m.named_parameters()})
    for name, p in grown[0].named_parameters():
        want = synced[name].double() + adasum(deltas[0][name], deltas[1][name]).reshape(p.shape)
        assert torch.allclose(p.detach().double(), want, rtol=1e-5, atol=1e-6), (step, name, p, want)
        synced[name] = want.float()
    checks += 1
assert not torch.equal(grown[0].body.weight, base2.body.weight) and not torch.equal(grown[0].unused.weight,
                                                                                     base2.unused.weight)

# a second backward before step(): Horovod's error; zero_grad between backward and step throws that step's
# gradients away (Horovod refused it): the deltas sent are dropped and the local steps undone, so a step on no
# gradient leaves the parameters and the momentum as they were
x, y = batch(r, 9)
opt.zero_grad()
before = [p.detach().clone() for p in model.parameters()]
momenta = {p: opt.state[p]["momentum_buffer"].clone() for p in model.parameters() if p in opt.state}
torch.nn.functional.mse_loss(model(x), y).backward(retain_graph=True)
raises(RuntimeError, lambda: torch.nn.functional.mse_loss(model(x), y).backward(), "computed more than",
       "backward_passes_per_step=1")
opt.zero_grad()
opt.step()  # every rank finishes the step it started
assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), "thrown-away gradients moved the model"
assert len(momenta) == 4 and all(torch.equal(opt.state[p]["momentum_buffer"], m) for p, m in momenta.items()), \
    "thrown-away gradients moved the momentum"
checks += 2
# compression=fp16: the deltas travel as float16 (as Horovod's Adasum optimizer compresses them): the change
# applied is the Adasum of the float16-rounded deltas, rounded to float16
m16 = copy.deepcopy(base)
opt16 = hvd.DistributedOptimizer(sgd(m16), named_parameters=m16.named_parameters(), op=hvd.Adasum,
                                 compression=hvd.Compression.fp16)
opt16.zero_grad()
x, y = batch(r, 20)
torch.nn.functional.mse_loss(m16(x), y).backward()
opt16.step()
start = {k: v.detach().clone() for k, v in base.state_dict().items()}
deltas = []
for k in range(n):
    ref = copy.deepcopy(base)
    ref_opt = sgd(ref)
    xk, yk = batch(k, 20)
    torch.nn.functional.mse_loss(ref(xk), yk).backward()
    ref_opt.step()
    deltas.append({name: p.detach() - start[name] for name, p in ref.named_parameters()})
rounded = 0
for name, p in m16.named_parameters():
    full = adasum(deltas[0][name], deltas[1][name]).reshape(p.shape)
    half = adasum(deltas[0][name].half(), deltas[1][name].half()).reshape(p.shape).half()
    want = start[name] + half.float()
    assert torch.allclose(p.detach(), want, rtol=0, atol=1e-7), (name, p, want)
    rounded += not torch.allclose(p.detach(), start[name] + full.float(), rtol=0, atol=1e-7)
assert rounded, "the fp16 deltas equal the uncompressed ones: the check proves nothing"
checks += 1
raises(ValueError, lambda: hvd.DistributedOptimizer(sgd(Net()), op=hvd.Adasum, gradient_predivide_factor=2.0),
       "gradient_predivide_factor")
checks += 1
hvd.shutdown()
say(f"OK rank={r} checks={checks}")
