"""torch.distributed's parallelism libraries on the ``aiacc`` backend, against one process or gloo in the same job.

``tp``: tensor parallelism (``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``, eager and
compiled) trains to the parameters of one process on the full model and of the same run over gloo; DTensor's
``distribute_tensor`` / ``redistribute`` / ``full_tensor`` and the functional collectives (also compiled) give
the reference values, and run on the aiacc group (its operation counts grow).
``pp``: pipeline parallelism (``PipelineStage`` with ``ScheduleGPipe`` and ``Schedule1F1B``, ``pipeline()`` with a
split point) gives the loss and gradients of one process; ``batch_isend_irecv``; ``monitored_barrier``, also past
its timeout with a rank late (an error naming the late rank, the group usable after it).
``dcp <dir>``: distributed checkpoint of an FSDP2 model and its Adam state (``dcp.save`` / ``dcp.load``,
``get_state_dict`` / ``set_state_dict``), ``dcp.async_save``, a full state dict broadcast from rank 0, a model made
on the meta device loaded from a checkpoint.
"""

import datetime
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

import aiacc.torch  # noqa: F401 - registers the backend
from one_process import Checks
from report import raises, say

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

elif part == "pp":
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        SplitPoint,
        pipeline,
    )

    assert n == 2, "the pipeline part runs on 2 ranks"

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

        def forward(self, x):
            return self.c(torch.relu(self.b(torch.relu(self.a(x)))))

    torch.manual_seed(1)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    MICRO = 4
    ref = Net()
    ref_losses = [mse(ref(xs), ys) for xs, ys in zip(x.chunk(MICRO), y.chunk(MICRO))]
    (sum(ref_losses) / MICRO).backward()  # the schedules scale the gradients by the number of microbatches
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}

    def run(schedule, stage, what):
        losses = []
        if r == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
            for k, (got, want) in enumerate(zip(losses, ref_losses)):
                same(f"{what}: loss of microbatch {k}", got.detach(), want.detach(), 1e-6)
        for k, p in stage.submod.named_parameters():
            same(f"{what}: gradient of {k}", p.grad, ref_grads[k], 1e-6)

    for schedule_class in (ScheduleGPipe, Schedule1F1B):
        full = Net()
        submod = nn.Sequential()
        if r == 0:
            submod.a, submod.relu1, submod.b, submod.relu2 = full.a, nn.ReLU(), full.b, nn.ReLU()
        else:
            submod.c = full.c
        stage = PipelineStage(submod, r, n, torch.device("cpu"))
        run(schedule_class(stage, n_microbatches=MICRO, loss_fn=mse), stage, f"PipelineStage, {schedule_class.__name__}")

    pipe = pipeline(Net(), mb_args=(x.chunk(MICRO)[0],), split_spec={"c": SplitPoint.BEGINNING})
    stage = pipe.build_stage(r, torch.device("cpu"))
    run(ScheduleGPipe(stage, n_microbatches=MICRO, loss_fn=mse), stage, "pipeline(), ScheduleGPipe")

    # batch_isend_irecv: two tensors each way between the ranks, in one batch
    ahead, behind = (r + 1) % n, (r - 1) % n
    sends = [torch.full((3,), 10.0 * r), torch.arange(5, dtype=torch.int64) + r]
    got = [torch.empty(3), torch.empty(5, dtype=torch.int64)]
    ops = [dist.P2POp(dist.isend, sends[0], ahead), dist.P2POp(dist.irecv, got[0], behind),
           dist.P2POp(dist.isend, sends[1], ahead), dist.P2POp(dist.irecv, got[1], behind)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    same("batch_isend_irecv float32", got[0], torch.full((3,), 10.0 * behind))
    same("batch_isend_irecv int64", got[1], torch.arange(5, dtype=torch.int64) + behind)

    # monitored_barrier (torch's function refused every backend but gloo): passes; past its timeout, with rank 1
    # not there, each rank that is raises naming rank 1; rank 1 comes later (once rank 0 says so over gloo) and
    # the group goes on
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
    dist.monitored_barrier(wait_all_ranks=True)
    checks.count += 1
    if r == 0:
        for wait_all in (False, True):
            raises(RuntimeError, lambda: dist.monitored_barrier(timeout=datetime.timedelta(seconds=1),
                                                                wait_all_ranks=wait_all),
                   "[Rank 0]: Rank 1 failed to pass monitoredBarrier in 1000 ms",
                   "monitored_barrier on the process group")
            checks.count += 1
    dist.barrier(gloo)
    if r == 1:
        dist.monitored_barrier()
        dist.monitored_barrier()
    t = torch.ones(3)
    dist.all_reduce(t)
    same("all_reduce after a monitored_barrier that timed out", t, torch.full((3,), float(n)))

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
