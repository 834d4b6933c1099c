"""DistributedOptimizer on torch.compile'd models equals the eager model trained on the whole batch in one
process (parameters within 1e-5), for the whole model compiled, for blocks compiled one by one (regional
compilation, which keeps overlap with backward) and with backward_passes_per_step=2, and under compiled autograd;
overlap_forward on a compiled model is refused with an error (updates applied from hooks inside a compiled graph
come too late).
Usage: torch_compile.py BACKEND (inductor, or aot_eager for the variants)."""

import sys
import warnings

import torch
import torch.nn as nn

import aiacc.torch as hvd
from report import say

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
BACKEND = sys.argv[1]
BATCH, STEPS = 12, 6
checks = 0


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 4))


g = torch.Generator().manual_seed(1)
DATA = [(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)) for _ in range(2 * STEPS)]


def train(model, opt, rows, passes, run=None):
    run = run or model
    for step in range(STEPS):
        opt.zero_grad()
        for x, y in DATA[step * passes:(step + 1) * passes]:
            nn.functional.mse_loss(run(x[rows]), y[rows]).backward()
        opt.step()
    if hasattr(opt, "synchronize_forward"):
        opt.synchronize_forward()


def check(label, compile_how, passes=1, overlap_forward=False):
    global checks
    ref = net()
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), slice(0, BATCH), passes)
    model = net()
    run = model
    if compile_how == "whole":
        run = torch.compile(model, backend=BACKEND)
    else:  # every block on its own: a backward graph per block, so gradients reach the engine block by block
        for block in (model[0], model[2], model[3]):
            block.compile(backend=BACKEND)
    named = run.named_parameters()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=named, backward_passes_per_step=passes,
                                       overlap_forward=overlap_forward)
    warned = [str(w.message) for w in seen if "as one graph" in str(w.message)]
    assert bool(warned) == (compile_how == "whole"), (label, warned)
    arrived = []
    for i, p in enumerate(model.parameters()):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: arrived.append(i))
    train(model, opt, slice(r * BATCH // n, (r + 1) * BATCH // n), passes, run)
    if compile_how == "blocks":  # backward hands gradients over block by block, the last block's first:
        first = arrived[:len(list(model.parameters()))]  # the engine gets them while earlier blocks compute
        assert first.index(4) < first.index(2) < first.index(0), first
    for i, (p, q) in enumerate(zip(model.parameters(), ref.parameters())):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), f"{label}: parameter {i} max err {(p - q).abs().max()}"
    checks += 1


check("whole model compiled", "whole")
check("blocks compiled", "blocks")
if BACKEND != "inductor":  # the variants: the same hooks, a cheaper compiler
    check("whole model, backward_passes_per_step=2", "whole", passes=2)
    for how in ("blocks", "whole"):  # refused, never silently wrong
        try:
            check(f"{how}, overlap_forward", how, overlap_forward=True)
        except RuntimeError as exc:
            assert "overlap_forward does not work with torch.compile'd modules" in str(exc), exc
            checks += 1
        else:
            raise AssertionError(f"{how}, overlap_forward: no error")


def compiled_autograd_steps(rows, dist):
    """torch's compiled autograd (``compiled_autograd = True``, the backward inside a compiled training step): the
    gradient hooks that hand gradients to the engine run as they are, inside the compiled backward."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if dist:
        opt = hvd.DistributedOptimizer(opt, named_parameters=[(f"ca.{k}", p) for k, p in model.named_parameters()])

    @torch.compile(backend=BACKEND)
    def forward_backward(x, y):
        nn.functional.mse_loss(model(x), y).backward()

    for x, y in DATA[:STEPS]:
        opt.zero_grad()
        forward_backward(x[rows], y[rows])
        opt.step()
    if dist:
        opt.remove_hooks()
    return list(model.parameters())


if BACKEND != "inductor":
    from torch._dynamo.utils import counters
    torch._dynamo.config.compiled_autograd = True
    got = compiled_autograd_steps(slice(r * BATCH // n, (r + 1) * BATCH // n), True)
    assert counters["compiled_autograd"]["captures"] > 0, dict(counters["compiled_autograd"])  # (it did run)
    want = compiled_autograd_steps(slice(0, BATCH), False)
    torch._dynamo.config.compiled_autograd = False
    for i, (p, q) in enumerate(zip(got, want)):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), f"compiled autograd: parameter {i} max err {(p - q).abs().max()}"
    checks += 1
say(f"OK rank={r} checks={checks}")
