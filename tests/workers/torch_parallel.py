"""torch.distributed's parallelism libraries on the ``aiacc`` backend, against one process or gloo in the same job.

``tp``: tensor parallelism (``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``, eager and
compiled) trains to the parameters of one process on the full model and of the same run over gloo; DTensor's
``distribute_tensor`` / ``redistribute`` / ``full_tensor`` and the functional collectives (also compiled) give
the reference values, and run on the aiacc group (its operation counts grow).
``dcp <dir>``: distributed checkpoint of an FSDP2 model and its Adam state (``dcp.save`` / ``dcp.load``,
``get_state_dict`` / ``set_state_dict``), ``dcp.async_save``, a full state dict broadcast from rank 0, a model made
on the meta device loaded from a checkpoint.
"""

import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

import aiacc.torch  # noqa: F401 - registers the backend
from one_process import Checks
from report import say

warnings.filterwarnings("ignore")  # torch's warnings about its prototype APIs
torch.set_num_threads(1)
dist.init_process_group("aiacc")
r, n = dist.get_rank(), dist.get_world_size()
part = sys.argv[1]
checks = Checks(rank=r)
same = checks.equal
gloo = dist.new_group(backend="gloo")

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402

mesh = init_device_mesh("cpu", (n,))
pg = mesh.get_group()
assert type(pg).__name__ == "AiaccProcessGroup", pg


def counts():
    """The aiacc group's operations so far, by kind."""
    return dict(pg._seq)


def mse(out, target):
    return ((out - target) ** 2).mean()


if part == "tp":
    from torch.distributed._functional_collectives import (
        all_gather_tensor,
        all_reduce,
        all_to_all_single,
        broadcast,
        reduce_scatter_tensor,
    )
    from torch.distributed.tensor import (
        DTensor,
        Partial,
        Replicate,
        Shard,
        distribute_tensor,
    )
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.up, self.down = nn.Linear(8, 4 * n), nn.Linear(4 * n, 5)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    torch.manual_seed(1)
    DATA = [(torch.randn(6, 8), torch.randn(6, 5)) for _ in range(3)]

    def train(model, run=None):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for x, y in DATA:
            opt.zero_grad()
            mse((model if run is None else run)(x), y).backward()
            opt.step()
        return [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in model.parameters()]

    def tp_model(on):
        return parallelize_module(MLP(), on, {"up": ColwiseParallel(), "down": RowwiseParallel()})

    reference = train(MLP())
    before = counts()
    model = tp_model(mesh)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    got = train(model)
    assert counts()["allreduce"] - before.get("allreduce", 0) >= len(DATA), (before, counts())  # (on aiacc's group)
    gloo_got = train(tp_model(DeviceMesh.from_group(gloo, "cpu")))
    compiled = tp_model(mesh)
    compiled_got = train(compiled, torch.compile(compiled, backend="aot_eager"))
    for i, (p, q, g, c) in enumerate(zip(got, reference, gloo_got, compiled_got)):
        same(f"tensor parallel parameter {i}: as one process", p, q, 1e-6)
        same(f"tensor parallel parameter {i}: as over gloo", p, g)
        same(f"compiled tensor parallel parameter {i}: as eager", c, p, 1e-6)

    # DTensor: rows that do not divide among the ranks (5), every dtype kind
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        torch.manual_seed(2)
        full = (torch.randn(5, 7) * 10).to(dtype)
        d = distribute_tensor(full, mesh, [Shard(0)])
        same(f"distribute_tensor {dtype}: this rank's rows", d.to_local(), full.chunk(n)[r])
        same(f"Shard(0) -> Replicate {dtype}", d.redistribute(mesh, [Replicate()]).to_local(), full)
        same(f"full_tensor {dtype}", d.full_tensor(), full)
        same(f"Shard(0) -> Shard(1) {dtype}", d.redistribute(mesh, [Shard(1)]).to_local(), full.chunk(n, 1)[r])
        partial = DTensor.from_local(torch.ones(5, 7, dtype=dtype) * (r + 1), mesh, [Partial()])
        total = torch.ones(5, 7, dtype=dtype) * (n * (n + 1) // 2)
        same(f"Partial -> Replicate {dtype}", partial.redistribute(mesh, [Replicate()]).to_local(), total)
        same(f"Partial -> Shard(0) {dtype}", partial.redistribute(mesh, [Shard(0)]).to_local(), total.chunk(n)[r])

    # the functional collectives (torch's _c10d_functional ops, found by the group's name), eager and compiled
    before = counts()
    mine = torch.arange(4.0) + 10 * r
    every = torch.stack([torch.arange(4.0) + 10 * k for k in range(n)])
    same("functional all_reduce", all_reduce(mine, "sum", mesh), every.sum(0))
    same("functional all_gather_tensor", all_gather_tensor(mine, 0, mesh), every.reshape(-1))
    rows = torch.arange(2.0 * n) + 10 * r
    same("functional reduce_scatter_tensor", reduce_scatter_tensor(rows, "sum", 0, mesh),
         torch.stack([torch.arange(2.0 * n) + 10 * k for k in range(n)]).sum(0).chunk(n)[r])
    same("functional all_to_all_single", all_to_all_single(rows, None, None, mesh),
         torch.cat([(torch.arange(2.0 * n) + 10 * k).chunk(n)[r] for k in range(n)]))
    same("functional broadcast", broadcast(mine, n - 1, mesh), every[n - 1])
    assert all(counts().get(k, 0) > before.get(k, 0) for k in ("allreduce", "allgather", "reducescatter", "alltoall",
                                                                 "broadcast")), (before, counts())
    checks.count += 1

    @torch.compile(backend="aot_eager")
    def compiled_reduce(x):
        return all_reduce(x * 2, "sum", mesh) + 1

    @torch.compile(backend="aot_eager")
    def compiled_replicate(d):
        return d.redistribute(mesh, [Replicate()]).to_local() * 2

    before = counts()
    same("compiled functional all_reduce", compiled_reduce(mine), every.sum(0) * 2 + 1)
    full = torch.arange(20.0).reshape(5, 4)
    same("compiled DTensor redistribute", compiled_replicate(distribute_tensor(full, mesh, [Shard(0)])), full * 2)
    assert counts()["allreduce"] > before["allreduce"] and counts()["allgather"] > before["allgather"], \
        (before, counts())
    checks.count += 1

elif part == "dcp":
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    folder = sys.argv[2]

    def net():
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def make(seed=0):
        torch.manual_seed(seed)
        model = net()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    torch.manual_seed(1)
    DATA = [(torch.randn(4 * n, 8), torch.randn(4 * n, 4)) for _ in range(6)]

    def train(model, opt, batches):
        for x, y in batches:
            opt.zero_grad()
            mse(model(x[r::n]), y[r::n]).backward()
            opt.step()

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    def flat_state(model, opt):
        """Every parameter and optimizer state value, whole, by name."""
        model_sd, optim_sd = get_state_dict(model, opt)
        out = {f"model.{k}": full(v).clone() for k, v in model_sd.items()}
        for k, state in optim_sd["state"].items():
            out.update({f"optim.{k}.{s}": full(v).clone() for s, v in state.items()})
        return out

    model, opt = make()
    train(model, opt, DATA)
    uninterrupted = [p.full_tensor() for p in model.parameters()]

    model, opt = make()
    train(model, opt, DATA[:3])
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{folder}/ckpt")
    saved = flat_state(model, opt)

    fresh, fresh_opt = make(seed=1 + r)  # other parameters on every rank, no optimizer state yet
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=f"{folder}/ckpt")
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = flat_state(fresh, fresh_opt)
    assert sorted(loaded) == sorted(saved) and any(k.endswith("exp_avg_sq") for k in saved), (sorted(loaded),
                                                                                              sorted(saved))
    for k in saved:
        same(f"dcp.load: {k}", loaded[k], saved[k])
    train(fresh, fresh_opt, DATA[3:])
    for i, (p, q) in enumerate(zip(fresh.parameters(), uninterrupted)):
        same(f"trained on after dcp.load: parameter {i} as uninterrupted", p.full_tensor(), q)

    # dcp.async_save (it refused a process group without a CPU device: "A CPU backend must be enabled"), loaded
    # into a plain model on every rank
    dcp.async_save({"model": get_model_state_dict(model)}, checkpoint_id=f"{folder}/async").result()
    plain = net()
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=f"{folder}/async")
    plain.load_state_dict(state["model"])
    for i, (p, q) in enumerate(zip(plain.parameters(), model.parameters())):
        same(f"dcp.async_save, loaded into a plain model: parameter {i}", p.detach(), q.full_tensor())

    # a full state dict from rank 0 alone, broadcast (it raised IndexError), into a model sharded from other values
    sharded, _ = make(seed=5 + r)
    set_model_state_dict(sharded, plain.state_dict() if r == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for i, (p, q) in enumerate(zip(sharded.parameters(), plain.parameters())):
        same(f"set_model_state_dict broadcast_from_rank0: parameter {i}", p.full_tensor(), q.detach())

    # a model made on the meta device, sharded, then loaded from the checkpoint
    with torch.device("meta"):
        meta = net()
    fully_shard(meta, mesh=mesh)
    meta.to_empty(device="cpu")
    state = {"model": get_model_state_dict(meta)}
    dcp.load(state, checkpoint_id=f"{folder}/async")
    set_model_state_dict(meta, state["model"])
    for i, (p, q) in enumerate(zip(meta.parameters(), plain.parameters())):
        same(f"meta-device model loaded by dcp: parameter {i}", p.full_tensor(), q.detach())

    full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    assert (len(full_sd) == 4) == (r == 0), len(full_sd)  # (gathered on rank 0 only)
    whole = {k: v.full_tensor() for k, v in model.state_dict().items()}  # (on every rank: collectives)
    for k, v in full_sd.items():
        same(f"full state dict on rank 0: {k}", v, whole[k])
else:
    raise SystemExit(f"unknown part {part!r}")

dist.destroy_process_group()
say(f"OK rank={r} checks={checks.count}")
