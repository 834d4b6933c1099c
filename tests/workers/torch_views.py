"""``aiacc.torch.allreduce_async_`` remembers each name's numpy view of its tensor (``arrays._view_of``):
whatever happens to the tensor under a name between calls (refilled, replaced, resized, viewed as another
dtype, a strided view at the same address, set to require grad), the reduction is that of the tensor
passed now, and ``synchronize`` returns that tensor."""

import torch

import aiacc.torch as hvd
from report import say

hvd.init()
r, n = hvd.rank(), hvd.size()
total = n * (n + 1) / 2  # the sum of r + 1 over the ranks
checks = 0


def reduce(t, name):
    h = hvd.allreduce_async_(t, op=hvd.Sum, name=name)
    assert hvd.synchronize(h) is t and hvd.poll(h)
    return t


def check(ok, what):
    global checks
    assert ok, what
    checks += 1


t = torch.zeros(10)
for step in range(3):  # the same tensor: its new values each time
    t.fill_(r + 1 + step)
    check(torch.all(reduce(t, "v.same") == total + n * step), ("same", step, t))
for step in range(3):  # a new tensor under the name every call
    u = torch.full((6,), float(r + 1 + step))
    check(torch.all(reduce(u, "v.new") == total + n * step), ("new", step, u))
base = torch.full((8,), float(r + 1))
reduce(base, "v.dtype")
ints = base.view(torch.int32)  # the same memory and shape, another dtype (negative: NaN bits as float32)
ints.fill_(-(r + 1))
check(ints.dtype == torch.int32 and torch.all(reduce(ints, "v.dtype") == -int(total)), ("dtype", ints))
grid = torch.zeros(4, 8)
flat = grid.view(-1)[:16].view(4, 4)  # contiguous, at grid's address
flat.fill_(r + 1)
reduce(flat, "v.strided")
grid.zero_()
cols = grid[:, :4]  # the same address and shape, strided: the slow path stages it
cols.fill_(r + 1)
reduce(cols, "v.strided")
want = torch.zeros(4, 8)
want[:, :4] = total
check(torch.equal(grid, want), ("strided", grid))
whole = torch.full((10,), float(r + 1))
reduce(whole, "v.shape")
whole.fill_(r + 1)
part = whole[:5]  # the same address, fewer elements: those after it stay as they are
check(torch.all(reduce(part, "v.shape") == total) and torch.all(whole[5:] == r + 1), ("shape", whole))
s = torch.full((10,), float(r + 1))
reduce(s, "v.resize")
s.resize_(5)  # the same tensor, fewer elements
s.fill_(r + 2)
check(s.shape == (5,) and torch.all(reduce(s, "v.resize") == total + n), ("resize", s))
g = torch.full((3,), float(r + 1))
reduce(g, "v.grad")
g.fill_(r + 1)
g.requires_grad_()  # reduced where it lies all the same (the memory, as for a tensor that needs no grad)
check(torch.all(reduce(g, "v.grad").detach() == total), ("grad", g))
say(f"OK rank={r} checks={checks}")
hvd.shutdown()
