"""``python -m aiacc.bench predict``: step time and scaling efficiency at N ranks on H hosts from one step's timeline.

::

    python -m aiacc.bench predict --profile resnet50_v100 --hosts 2 --ranks-per-host 2 --link 1gbit --dilate 10
    python -m aiacc.bench predict ... --measure        # also run `bench scaling` there and compare
    python -m aiacc.bench predict --profile resnet50_v100 --hosts 64 --ranks-per-host 4 --link 100gbit \\
        --dilate 1 --timeline profile --shm-gbps 1200   # a cluster that is not here

The inputs:

1. a timeline of one training step on one rank: when each layer's gradients are ready during
   backward, the forward and backward times, the optimizer's time. ``--timeline measured`` (the
   default) replays the profile here at ``--dilate K`` (one process, no communication) and reads
   the times off hooks; ``--timeline profile`` takes the profile's numbers as they are (times K,
   no optimizer time: the profile's step already holds it);
2. the engine's schedule: gradients go into buckets in the order they arrive, each closed once it
   holds ``--bucket-cap`` bytes (the first at 1 MiB): aiacc's ``GradientBuckets`` rule, which is
   also DDP's reducer's; a bucket is sent when its last gradient is ready, one at a time;
3. an alpha-beta network with hierarchy, per bucket of ``n`` bytes (``N = H x R`` ranks, link
   ``beta_link = RATE / 8 / K x efficiency`` bytes/s, shared memory ``beta_shm``):

   * ``aiacc`` and ``aiacc-hier`` (MPI; MPICH's allreduce is host-aware, measured on the emulated
     cluster to move the same bytes over the links as aiacc's hierarchical one): within the host
     ``2 (R-1)/R n / beta_shm``, across hosts a ring of H: ``2 (H-1) alpha + 2 (H-1)/H n / beta_link``;
   * ``ddp`` (gloo: one ring over all N ranks, TCP also within a host): ``2 (N-1) alpha +
     2 (N-1)/N n / min(beta_link, beta_loopback)`` (``beta_loopback`` alone on one host);

   plus a software cost per bucket (``--overhead-ms``: aiacc's negotiation cycle, DDP's hook);
   * ``aiacc-fp16`` / ``aiacc-bf16`` (``_sum16``: all-to-all and all-gather of 16-bit blocks within the
     host, then across hosts) and ``ddp-fp16`` (``fp16_compress_hook``): the same formulas on ``n / 2``
     bytes, plus the casts, which dilation does not stretch: ``CASTS`` passes over the float32 elements
     (aiacc: pack, the sums' two conversions, unpack; DDP: to half and back) at ``--cast-gelems``.

The prediction: buckets are sent in order, each starting when it is ready and the one before has
finished; ``T_step = forward + max(backward, end of the last bucket) + optimizer``, and
``scaling_eff = T_compute / T_step`` with ``T_compute = forward + backward + optimizer`` (the same
definitions as ``bench scaling``). Every parameter of the model is printed with the prediction, so
a reader can see what it assumed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import List, NamedTuple, Optional, Sequence

from .common import fraction, nonneg_float, nonneg_int, positive_float, positive_int
from .netem import LinkError, parse_rate
from .replay import ProfileError, load_profile, profile_names

__all__ = ["StepTimeline", "Network", "plan_buckets", "allreduce_seconds", "predict_step", "measure_timeline",
           "profile_timeline", "main"]

FIRST_BUCKET_CAP = 1 << 20  # aiacc.buckets.FIRST_BUCKET_CAP; DDP's first bucket too
IMPLS = ("aiacc", "aiacc-hier", "ddp", "aiacc-fp16", "aiacc-bf16", "ddp-fp16")
CASTS = {"aiacc-fp16": 4, "aiacc-bf16": 4, "ddp-fp16": 2}  # passes of a cast over each float32 element


class StepTimeline(NamedTuple):
    """One rank's step without communication (seconds). ``ready``: (seconds after backward began,
    bytes) per gradient tensor, in the order they became ready."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    ready: List[tuple]


class Network(NamedTuple):
    hosts: int
    ranks_per_host: int
    link_Bps: Optional[float]  # bytes/s of each host's link after dilation and efficiency; None: unlimited
    shm_Bps: float
    loopback_Bps: float
    alpha_s: float  # per message between hosts
    overhead_s: float  # software, per bucket
    cast_eps: float = 4e9  # float32 <-> 16-bit elements cast per second (16-bit implementations)


def plan_buckets(ready: Sequence[tuple], cap: int, first_cap: int = FIRST_BUCKET_CAP) -> List[tuple]:
    """[(ready time, bytes)] per bucket: gradients in arrival order, a bucket closed once it holds
    ``cap`` bytes (the first ``first_cap``), ready when its last gradient is."""
    buckets, size, last, limit = [], 0, 0.0, first_cap
    for t, nbytes in ready:
        size += nbytes
        last = max(last, t)
        if size >= limit:
            buckets.append((last, size))
            size, limit = 0, cap
    if size:
        buckets.append((last, size))
    return buckets


def allreduce_seconds(impl: str, nbytes: float, net: Network) -> float:
    """The alpha-beta time of one allreduce of ``nbytes`` (see the module's formulas)."""
    h, r = net.hosts, net.ranks_per_host
    n = h * r
    if n == 1:
        return 0.0
    link = float("inf") if net.link_Bps is None else net.link_Bps
    casts = CASTS.get(impl)
    if casts is not None:  # 16-bit on the wire: half the bytes, plus the casts
        base = "ddp" if impl.startswith("ddp") else "aiacc"
        return allreduce_seconds(base, nbytes / 2, net) + casts * (nbytes / 4) / net.cast_eps
    if impl == "ddp":
        beta = net.loopback_Bps if h == 1 else min(link, net.loopback_Bps if r > 1 else link)
        return net.overhead_s + 2 * (n - 1) * net.alpha_s + 2 * (n - 1) / n * nbytes / beta
    intra = 2 * (r - 1) / r * nbytes / net.shm_Bps if r > 1 else 0.0
    cross = 2 * (h - 1) * net.alpha_s + 2 * (h - 1) / h * nbytes / link if h > 1 else 0.0
    return net.overhead_s + intra + cross


class Prediction(NamedTuple):
    step_s: float
    compute_s: float
    comm_s: float  # all buckets back to back, nothing hidden
    buckets: int

    @property
    def scaling_eff(self) -> float:
        return self.compute_s / self.step_s


def predict_step(timeline: StepTimeline, impl: str, net: Network, cap: int) -> Prediction:
    end = 0.0
    buckets = plan_buckets(timeline.ready, cap)
    total = 0.0
    for ready, nbytes in buckets:
        cost = allreduce_seconds(impl, nbytes, net)
        end = max(end, ready) + cost
        total += cost
    compute = timeline.forward_s + timeline.backward_s + timeline.optimizer_s
    step = timeline.forward_s + max(timeline.backward_s, end) + timeline.optimizer_s
    return Prediction(step, compute, total, len(buckets))


def profile_timeline(profile, dilate: float) -> StepTimeline:
    """The profile's own times (x dilate): gradients of a layer ready at the end of its backward."""
    t, ready = 0.0, []
    for lay in reversed(profile.layers):
        t += lay.backward_ms * 1e-3 * dilate
        ready += [(t, 4 * _numel(shape)) for _, shape in lay.params]
    fwd = sum(lay.forward_ms for lay in profile.layers) * 1e-3 * dilate
    return StepTimeline(fwd, t, 0.0, ready)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def measure_timeline(profile, dilate: float, steps: int = 2) -> StepTimeline:
    """One process replays ``profile`` (no communication, an optimizer that updates nothing, as
    ``bench scaling`` by default) and reads one step's times off hooks;
    the last of ``steps`` steps (the first warms up)."""
    import torch  # noqa: PLC0415

    from .replay import build_model, no_update_optimizer  # noqa: PLC0415

    torch.set_num_threads(1)
    model = build_model(profile, dilate)
    opt = no_update_optimizer(model.parameters())  # as `bench scaling` (its --optimizer none)
    x = torch.ones(profile.batch_size)
    ready: List[tuple] = []
    origin = [0.0]
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(
            lambda p: ready.append((time.perf_counter() - origin[0], p.numel() * p.element_size())))
    for _ in range(steps):
        ready.clear()
        opt.zero_grad(set_to_none=False)
        t0 = time.perf_counter()
        loss = model(x).mean()
        t1 = origin[0] = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
    return StepTimeline(t1 - t0, t2 - t1, t3 - t2, list(ready))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aiacc.bench predict", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="resnet50_v100", help=f"{', '.join(profile_names())}, or a path")
    parser.add_argument("--hosts", type=positive_int, default=2)
    parser.add_argument("--ranks-per-host", type=positive_int, default=1)
    parser.add_argument("--link", default="1gbit", help="each host's link before dilation (e.g. 1gbit, 25gbit)")
    parser.add_argument("--dilate", type=positive_float, default=10.0)
    parser.add_argument("--impls", default="aiacc,ddp", help=f"comma list of {', '.join(IMPLS)}")
    parser.add_argument("--timeline", choices=["measured", "profile"], default="measured")
    parser.add_argument("--bucket-cap", type=positive_float, default=25.0, help="MiB per bucket (AIACC_BUCKET_CAP, DDP's 25)")
    parser.add_argument("--efficiency", type=fraction, default=0.88,
                        help="share of the link rate an allreduce gets (measured on the emulated cluster: 16 MiB "
                             "over 2 hosts at 1 Gbit/s, 110 MB/s bus bandwidth: 0.88)")
    parser.add_argument("--shm-gbps", type=positive_float, default=16.0,
                        help="intra-host bus bandwidth, Gbit/s (measured here: 16 MiB over shared memory, 2 ranks, "
                             "~2 GB/s)")
    parser.add_argument("--loopback-gbps", type=positive_float, default=24.0,
                        help="gloo's TCP within a host, Gbit/s (assumed, not measured)")
    parser.add_argument("--alpha-us", type=nonneg_float, default=50.0, help="latency per message between hosts, us")
    parser.add_argument("--overhead-ms", type=nonneg_float, default=1.0, help="software cost per bucket, ms")
    parser.add_argument("--cast-gelems", type=positive_float, default=4.0,
                        help="float32 <-> 16-bit casts, G elements/s (torch's here: ~8 for one cast, measured; "
                             "4 allows for the copies around it)")
    parser.add_argument("--measure", action="store_true", help="also run `bench scaling` here and compare")
    parser.add_argument("--steps", type=positive_int, default=10, help="with --measure: timed steps")
    parser.add_argument("--repeats", type=positive_int, default=3, help="with --measure: repeats")
    parser.add_argument("--warmup", type=nonneg_int, default=3, help="with --measure: untimed steps")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    impls = [i for i in args.impls.split(",") if i]
    bad = [i for i in impls if i not in IMPLS]
    if bad or not impls:
        parser.error(f"--impls: unknown {', '.join(bad) or '(none)'}; choose from {', '.join(IMPLS)}")
    try:
        profile = load_profile(args.profile)
        rate = parse_rate(args.link)
    except (ProfileError, LinkError) as exc:
        parser.error(str(exc))
    timeline = measure_timeline(profile, args.dilate) if args.timeline == "measured" else \
        profile_timeline(profile, args.dilate)
    net = Network(args.hosts, args.ranks_per_host,
                  None if rate is None else rate / 8 / args.dilate * args.efficiency,
                  args.shm_gbps * 1e9 / 8, args.loopback_gbps * 1e9 / 8, args.alpha_us * 1e-6, args.overhead_ms * 1e-3,
                  args.cast_gelems * 1e9)
    cap = int(args.bucket_cap * (1 << 20))
    measured = {}
    if args.measure:
        cmd = [sys.executable, "-m", "aiacc.bench", "scaling", "--profile", args.profile, "--hosts", str(args.hosts),
               "--ranks-per-host", str(args.ranks_per_host), "--link", args.link, "--dilate", str(args.dilate),
               "--impls", ",".join(impls), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--repeats", str(args.repeats), "--json"]
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if out.returncode != 0:
            print(f"aiacc.bench predict: --measure: `bench scaling` failed with status {out.returncode}",
                  file=sys.stderr)
            return out.returncode
        for line in out.stdout.splitlines():
            if line.startswith("{"):
                rec = json.loads(line)
                measured[rec["impl"]] = rec
    records = []
    for impl in impls:
        p = predict_step(timeline, impl, net, cap)
        rec = {"bench": "predict", "impl": impl, "profile": profile.name, "ranks": args.hosts * args.ranks_per_host,
               "hosts": args.hosts, "link": args.link, "dilate": args.dilate, "timeline": args.timeline,
               "buckets": p.buckets, "predicted_step_ms": p.step_s * 1e3, "predicted_compute_ms": p.compute_s * 1e3,
               "predicted_comm_ms": p.comm_s * 1e3, "predicted_scaling_eff": p.scaling_eff,
               "assumed": {"link_MBps": None if net.link_Bps is None else net.link_Bps / 1e6,
                           "shm_MBps": net.shm_Bps / 1e6, "loopback_MBps": net.loopback_Bps / 1e6,
                           "alpha_us": args.alpha_us, "overhead_ms": args.overhead_ms, "bucket_cap_MiB": args.bucket_cap,
                           "efficiency": args.efficiency, "cast_gelems": args.cast_gelems}}
        if impl in measured:
            m = measured[impl]
            rec.update(measured_step_ms=m["step_ms"], measured_scaling_eff=m["scaling_eff"],
                       error=(p.step_s * 1e3 - m["step_ms"]) / m["step_ms"])
        records.append(rec)
    for rec in records:
        if args.json:
            print(json.dumps(rec), flush=True)
            continue
        line = (f"impl={rec['impl']} ranks={rec['ranks']} hosts={rec['hosts']} link={rec['link']} "
                f"profile={rec['profile']} dilate={rec['dilate']:g} buckets={rec['buckets']} "
                f"predicted_step_ms={rec['predicted_step_ms']:.1f} "
                f"predicted_scaling_eff={rec['predicted_scaling_eff']:.3f}")
        if "measured_step_ms" in rec:
            line += (f" measured_step_ms={rec['measured_step_ms']:.1f} "
                     f"measured_scaling_eff={rec['measured_scaling_eff']:.3f} error={rec['error']:+.1%}")
        print(line, flush=True)
    if not args.json:
        a = records[0]["assumed"]
        print(f"assumed: timeline={args.timeline} link_MBps={a['link_MBps']} shm_MBps={a['shm_MBps']:.0f} "
              f"loopback_MBps={a['loopback_MBps']:.0f} alpha_us={a['alpha_us']:g} overhead_ms={a['overhead_ms']:g} "
              f"bucket_cap_MiB={a['bucket_cap_MiB']:g} efficiency={a['efficiency']:g} "
              f"cast_gelems={a['cast_gelems']:g}", flush=True)
    return 0
