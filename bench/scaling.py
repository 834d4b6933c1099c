"""``python -m aiacc.bench scaling``: scaling and overlap efficiency of data-parallel training on an emulated cluster.

::

    python -m aiacc.bench scaling --profile bert_base_v100 --hosts 2 --ranks-per-host 2 --link 25gbit --dilate 10
    python -m aiacc.bench scaling --profile resnet50_v100 --hosts 2 --ranks-per-host 1,2 --link 1gbit,10gbit \\
        --dilate 10 --impls aiacc,aiacc-hier,ddp --plot scaling.png

For every configuration (each combination of ``--hosts``, ``--ranks-per-host`` and ``--link``) it
makes an emulated cluster (``aiacc.bench.cluster``: one network namespace per host, links shaped
to RATE / K), starts ``hosts x ranks-per-host`` ranks on it through aiaccrun, and on every rank
trains the compute replay of ``--profile`` (``aiacc.bench.replay``: the real gradient shapes, each
layer sleeping its GPU time x K) with each implementation in turn:

  aiacc       aiacc.torch.DistributedOptimizer, default settings
  aiacc-fwd   the same with overlap_forward (each layer updated in its next forward)
  aiacc-hier  the same in a job with AIACC_HIERARCHICAL_ALLREDUCE=1 (its own job: a setting of init)
  ddp         torch DistributedDataParallel on gloo (ring allreduce over TCP), defaults
  aiacc-fp16  aiacc with compression=hvd.Compression.fp16 (gradients travel as float16)
  ddp-fp16    DDP with torch's fp16_compress_hook, its own way to send float16 gradients
  aiacc-bf16  aiacc with compression=hvd.Compression.bf16 (bfloat16 on the wire, summed in float32)

(The fp16 pair is how mixed-precision jobs are run: NVIDIA's BERT scripts, where the BERT profile's
times come from, pass Horovod ``Compression.fp16`` when AMP is on.)

It prints one line per implementation and configuration::

    impl=aiacc ranks=4 hosts=2 link=25gbit samples_per_s=... scaling_eff=... overlap_eff=... vs_ddp=...

Definitions (all times per step; a measurement is the slowest rank's time, the figure the median
over ``--repeats``):

* ``T_compute``: the replay model on each rank with the bare optimizer and no communication (the
  1-rank run, all ranks at once in the same job). The optimizer updates nothing by default
  (``--optimizer none``: the profile's layer times already hold the GPU's update; ``sgd`` runs
  plain SGD on this machine's CPU), and gradients stay allocated between steps.
* ``T_step``: the data-parallel step of the implementation.
* ``T_comm``: the implementation's step with compute dilated to 0, minus the same 1-rank step
  with compute 0: the time its communication takes when nothing hides it.
* ``samples_per_s = N * batch * K / T_step``, in undilated time (what the emulated GPUs would do).
* ``scaling_eff = throughput(N) / (N * throughput(1)) = T_compute / T_step``.
* ``overlap_eff = 1 - max(0, T_step - T_compute) / T_comm``, clamped to [0, 1]: the share of the
  communication time that compute hid. 1 = all of it hidden, 0 = none (T_step = T_compute + T_comm).
* ``vs_ddp = T_step(ddp) / T_step(impl)``.

Needs root (network namespaces), like ``--link``. Every line also comes as JSON with ``--json``.
``--plot FILE`` draws scaling efficiency against ranks, one line per implementation and link,
when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

from .common import emit, free_port, median, nonneg_int, positive_float, positive_int
from .replay import ProfileError, load_profile, profile_names

__all__ = ["main", "IMPLS", "derive"]

IMPLS = ("aiacc", "aiacc-fwd", "aiacc-hier", "ddp", "aiacc-fp16", "ddp-fp16", "aiacc-bf16")
RECORD = "SCALING-RECORD "
# implementations that need their own job, and the variables of that job
_JOB_ENV = {"aiacc-hier": {"AIACC_HIERARCHICAL_ALLREDUCE": "1"}}


def derive(rec: dict, ddp_step_s: Optional[float]) -> dict:
    """The reported figures from a worker's raw times (see the module's definitions)."""
    step, compute, comm = rec["step_s"], rec["compute_s"], rec["comm_s"]
    out = dict(rec)
    out["samples_per_s"] = rec["ranks"] * rec["batch"] * rec["dilate"] / step
    out["scaling_eff"] = compute / step
    exposed = max(0.0, step - compute)
    out["overlap_eff"] = 1.0 if comm <= 0 else min(1.0, max(0.0, 1.0 - exposed / comm))
    out["vs_ddp"] = ddp_step_s / step if ddp_step_s else None
    out.update(step_ms=step * 1e3, compute_ms=compute * 1e3, comm_ms=comm * 1e3)
    return out


def _csv(text: str, kind=str) -> list:
    return [kind(t) for t in text.split(",") if t.strip()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m aiacc.bench scaling", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="resnet50_v100", help=f"{', '.join(profile_names())}, or a path")
    parser.add_argument("--hosts", default="2", help="emulated hosts; a comma list sweeps (e.g. 1,2,4)")
    parser.add_argument("--ranks-per-host", default="1", help="ranks on each host; a comma list sweeps")
    parser.add_argument("--link", default="1gbit", help="each host's link (before dilation); a comma list sweeps")
    parser.add_argument("--latency", default="0", help="one-way latency between hosts (needs netem in the kernel)")
    parser.add_argument("--dilate", type=positive_float, default=10.0, help="stretch compute by K and slow the link by K")
    parser.add_argument("--impls", default="aiacc,ddp", help=f"comma list of {', '.join(IMPLS)}")
    parser.add_argument("--steps", type=positive_int, default=10, help="timed steps per measurement")
    parser.add_argument("--warmup", type=nonneg_int, default=3, help="untimed steps before each measurement")
    parser.add_argument("--repeats", type=positive_int, default=3, help="measurements per implementation; median reported")
    parser.add_argument("--optimizer", choices=["none", "sgd"], default="none",
                        help="none (default): step() only waits for communication, the profile's times already "
                             "hold the GPU's update; sgd: plain SGD on this machine's CPU")
    parser.add_argument("--plot", metavar="FILE", help="write scaling efficiency against ranks (needs matplotlib)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    try:
        load_profile(args.profile)
        hosts, per_host = _csv(args.hosts, int), _csv(args.ranks_per_host, int)
        links = _csv(args.link)
    except ProfileError as exc:
        parser.error(str(exc))
    except ValueError:
        parser.error("--hosts and --ranks-per-host take whole numbers, comma-separated")
    impls = _csv(args.impls)
    unknown = [i for i in impls if i not in IMPLS]
    if unknown or not impls:
        parser.error(f"--impls: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(IMPLS)}")
    for flag, values in (("--hosts", hosts), ("--ranks-per-host", per_host), ("--link", links)):
        if not values:
            parser.error(f"{flag}: no value given (a number, or a comma list to sweep)")
        if flag != "--link" and min(values) < 1:
            parser.error(f"{flag} {','.join(map(str, values))}: must be at least 1")
    from .. import config  # noqa: PLC0415

    if config.mpi_world_size_hint() > 1:
        print("aiacc.bench scaling starts its own ranks on an emulated cluster; run it without aiaccrun",
              file=sys.stderr)
        return 2
    from .cluster import ClusterError, EmulatedCluster  # noqa: PLC0415

    for link in links:  # every configuration's settings checked before the first one runs (made, not set up)
        for h in hosts:
            try:
                EmulatedCluster(h, link, args.latency, dilate=args.dilate)
            except ClusterError as exc:
                parser.error(str(exc))
    # jobs: the implementations that share a job run in one; the others each in their own
    groups: Dict[str, List[str]] = {}
    for impl in impls:
        groups.setdefault(impl if impl in _JOB_ENV else "", []).append(impl)
    results = []
    for link in links:
        for h in hosts:
            for r in per_host:
                raw = []
                try:
                    with EmulatedCluster(h, link, args.latency, dilate=args.dilate) as cluster:
                        for key, members in groups.items():
                            worker = [sys.executable, "-m", "aiacc.bench.scaling", "--worker", "--profile",
                                      args.profile, "--dilate", str(args.dilate), "--impls", ",".join(members),
                                      "--steps", str(args.steps), "--warmup", str(args.warmup),
                                      "--repeats", str(args.repeats), "--hosts", str(h),
                                      "--optimizer", args.optimizer]

                            def take(line: str) -> None:
                                if line.startswith(RECORD):
                                    raw.append(json.loads(line[len(RECORD):]))
                                else:
                                    print(line, file=sys.stderr, flush=True)

                            code = cluster.run(worker, r, env=dict(os.environ, OMP_NUM_THREADS="1",
                                                                   **_JOB_ENV.get(key, {})), on_line=take)
                            if code != 0:
                                print(f"aiacc.bench scaling: the job for {','.join(members)} on {h} host(s) x {r} "
                                      f"rank(s), link {link}, failed with status {code}", file=sys.stderr)
                                return code
                except ClusterError as exc:
                    print(f"aiacc.bench scaling: {exc}", file=sys.stderr)
                    return 2
                ddp = next((rec["step_s"] for rec in raw if rec["impl"] == "ddp"), None)
                for rec in raw:
                    rec["link"] = link
                    results.append(derive(rec, ddp))
                _print(results[-len(raw):], args.json)
    if args.plot:
        _plot(results, args.plot)
    return 0


def _print(records: List[dict], as_json: bool) -> None:
    if as_json:
        emit(records, True)
        return
    for rec in records:
        vs = "n/a" if rec["vs_ddp"] is None else f"{rec['vs_ddp']:.3f}"
        print(f"impl={rec['impl']} ranks={rec['ranks']} hosts={rec['hosts']} link={rec['link']} "
              f"profile={rec['profile']} dilate={rec['dilate']:g} samples_per_s={rec['samples_per_s']:.1f} "
              f"scaling_eff={rec['scaling_eff']:.3f} overlap_eff={rec['overlap_eff']:.3f} vs_ddp={vs} "
              f"step_ms={rec['step_ms']:.1f} compute_ms={rec['compute_ms']:.1f} comm_ms={rec['comm_ms']:.1f}",
              flush=True)


def _plot(results: List[dict], path: str) -> None:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
        import matplotlib.ticker  # noqa: PLC0415, F401
    except ImportError:
        print(f"aiacc.bench scaling: --plot {path}: matplotlib is not installed (pip install matplotlib); "
              "no plot written", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    series: Dict[tuple, List[tuple]] = {}
    for rec in results:
        series.setdefault((rec["impl"], rec["link"]), []).append((rec["ranks"], rec["scaling_eff"]))
    for (impl, link), points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{impl}, {link}")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("ranks")
    ax.set_ylabel("scaling efficiency")
    ax.set_ylim(0, 1.1)
    prof = results[0]["profile"] if results else ""
    ax.set_title(f"{prof}, dilate {results[0]['dilate']:g}" if results else "")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot={path}", file=sys.stderr)


# -- the ranks' side ----------------------------------------------------------------------------------

def _worker(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="aiacc.bench.scaling --worker")
    parser.add_argument("--profile", required=True)
    parser.add_argument("--dilate", type=float, required=True)
    parser.add_argument("--impls", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--hosts", type=int, required=True)
    parser.add_argument("--optimizer", choices=["none", "sgd"], required=True)
    args = parser.parse_args(argv)
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    import aiacc.torch as hvd  # noqa: PLC0415

    from .replay import build_model, no_update_optimizer  # noqa: PLC0415

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    impls = _csv(args.impls)
    uses_gloo = any(i.startswith("ddp") for i in impls)
    if uses_gloo:
        # gloo between the hosts' addresses (rank 0's host), over the shaped links (GLOO_SOCKET_IFNAME)
        where = None
        if rank == 0:
            host = os.environ.get("PMI_HOSTNAME") or "127.0.0.1"
            where = (host, free_port(host))
        host, port = hvd.broadcast_object(where, 0, name="scaling.gloo.address")
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=size)
    profile = load_profile(args.profile)
    x = torch.full((profile.batch_size,), float(rank + 1))

    def timed(model, opt, finish=None) -> float:
        """Seconds per step on the slowest rank, over ``steps`` steps after ``warmup``."""
        def step():
            opt.zero_grad(set_to_none=False)  # gradients stay allocated (see aiacc.bench.replay)
            model(x).mean().backward()
            opt.step()

        for _ in range(args.warmup):
            step()
        if finish:
            finish()
        hvd.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        if finish:
            finish()
        mine = (time.perf_counter() - start) / args.steps
        return max(hvd.allgather_object(mine, name="scaling.time"))

    def measure(model, opt, replay, finish=None):
        """(median step seconds at the profile's dilation, the same with no compute)."""
        with_compute = [timed(model, opt, finish) for _ in range(args.repeats)]
        replay.set_dilate(0)
        no_compute = [timed(model, opt, finish) for _ in range(args.repeats)]
        replay.set_dilate(args.dilate)
        return median(with_compute), median(no_compute)

    def sgd(model):
        if args.optimizer == "none":
            return no_update_optimizer(model.parameters())
        return torch.optim.SGD(model.parameters(), lr=1e-3)

    # throughput(1): every rank alone, no communication, in this same job
    single = build_model(profile, args.dilate)
    compute_s, compute0_s = measure(single, sgd(single), single)
    del single
    gc.collect()
    for impl in impls:
        replay = build_model(profile, args.dilate)
        finish = None
        if impl.startswith("ddp"):
            model = torch.nn.parallel.DistributedDataParallel(replay)
            if impl == "ddp-fp16":
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: PLC0415

                model.register_comm_hook(None, default_hooks.fp16_compress_hook)
            opt = sgd(model)
        else:
            named = [(f"{impl}.{n}", p) for n, p in replay.named_parameters()]
            compression = {"aiacc-fp16": hvd.Compression.fp16, "aiacc-bf16": hvd.Compression.bf16}.get(
                impl, hvd.Compression.none)
            opt = hvd.DistributedOptimizer(sgd(replay), named_parameters=named, overlap_forward=impl == "aiacc-fwd",
                                           compression=compression)
            model = replay
            if impl == "aiacc-fwd":
                finish = opt.synchronize
        step_s, step0_s = measure(model, opt, replay, finish)
        if rank == 0:
            rec = {"bench": "scaling", "impl": impl, "profile": profile.name, "ranks": size, "hosts": args.hosts,
                   "batch": profile.batch_size, "dilate": args.dilate, "step_s": step_s, "compute_s": compute_s,
                   "comm_s": max(0.0, step0_s - compute0_s), "steps": args.steps, "repeats": args.repeats}
            print(RECORD + json.dumps(rec), flush=True)
        del model, opt, replay
        gc.collect()
    if uses_gloo:
        dist.destroy_process_group()
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
