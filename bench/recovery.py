"""Restart-based recovery, measured: runs with a rank SIGKILLed at a random step, and the cost of a commit.

    python -m aiacc.bench recovery [--runs 10] [--np 2] [--state-mb 100]

(``aiacc.bench.recovery``; each run's ranks run this module too.)

Not under aiaccrun: each run is its own ``aiaccrun -np N --max-restarts 1 --elastic-dir DIR`` job of a small
deterministic PyTorch training (an MLP, ``hvd.elastic.TorchState`` committed every step) in which a random
rank kills itself with SIGKILL at a random step of the first start. Per run it prints whether the final
parameters equal a one-process run on the whole batch without interruption (``allclose``, 1e-5
relative, 1e-6 absolute) and the
recovery time: from the kill to the first step of the restarted job (launcher teardown, the new start,
imports, ``init``, loading and broadcasting the last commit). Then the median.

``--state-mb``: two more jobs, of 2 ranks, with a model of that many MB, that time blocks of 6 training steps
with and without ``state.commit()`` after each step (alternating, median of ``--repeats``, default 3): the
share of step time a commit costs (buffers copied in the call; parameters and optimizer state copied by a
thread while the next forward and backward run, and the file written by another), with ``--elastic-dir``
(``to=file``) and without (``to=memory``: the in-memory copy only). A block is timed in the steady state of
a loop that commits every step: a commit is in flight when its clock starts and its last commit finishes
after the clock stops, so each timed step overlaps one commit's background work (until 2026-12-01 the
block also waited for its last write to reach the disk: one whole write per 6 steps that a long loop
pays once). ``--compute PROFILE`` trains the compute replay of a profile instead of the MLP (its
parameters are the state, layers sleep a GPU's time: the CPU is free while they compute, as on a GPU
node). Also rank 0's CPU time per step (all
its threads; ``process_time``), which depends less than wall time on what else runs on the machine: on a
machine whose cores all compute, a commit's CPU time is what it costs the training loop.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

import torch

import aiacc.torch as hvd
from aiacc.bench.common import emit, median, nonneg_float, nonneg_int, positive_float, positive_int

STEPS, BATCH = 12, 12


def _replay_job(profile: str, dilate: float, rank: int):
    """(one_step, model, optimizer) of the compute replay of ``profile``: layers that sleep a GPU's time."""
    from aiacc.bench.replay import build_model, load_profile  # noqa: PLC0415

    model = build_model(load_profile(profile), dilate)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    x = torch.full((BATCH,), float(rank + 1))

    def one_step(_k: int) -> None:
        opt.zero_grad(set_to_none=False)  # gradients stay allocated (see aiacc.bench.replay)
        model(x).mean().backward()
        opt.step()

    return one_step, model, opt


def _rank_program(kill_rank: int, kill_step: int, state_mb: float, repeats: int = 3, compute: str = "cpu",
                  dilate: float = 1.0) -> None:
    torch.set_num_threads(1)
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    # the MLP's square layer holds state_mb when it is the commit-cost job's model (a replay replaces it)
    width = int((state_mb * 2 ** 20 / 4) ** 0.5) if state_mb and compute == "cpu" else 64

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
                                   torch.nn.Tanh(), torch.nn.Linear(width, 4))

    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)) for _ in range(STEPS)]
    model = net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
    rows = slice(r * BATCH // n, (r + 1) * BATCH // n)

    @hvd.elastic.run
    def train(state):
        if hvd.elastic.restart_count():
            print(f"RESUMED rank={r} step={state.step} t={time.time():.6f}", flush=True)
        while state.step < STEPS:
            if r == kill_rank and state.step == kill_step and hvd.elastic.restart_count() == 0:
                print(f"KILL rank={r} step={state.step} t={time.time():.6f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = data[state.step]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            opt.step()
            state.step += 1
            state.commit()

    if state_mb:  # the cost of committing: the same steps timed with and without a commit after each
        from aiacc.elastic import _commit_store  # noqa: PLC0415 - the bench waits for the last write

        def one_step(k: int) -> None:
            x, y = data[k]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            opt.step()

        if compute != "cpu":  # the state of a real network, trained with GPU-class compute (slept)
            del state, opt, model
            one_step, model, opt = _replay_job(compute, dilate, r)
            state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
        state_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 20

        def block(commit: bool):
            """(wall seconds, CPU seconds of this process, all its threads) per step of a loop that commits
            after every step, in its steady state: the block starts with a commit in flight (made before
            the clock starts) and its last commit is finished after the clock stops, so each timed step
            overlaps exactly one commit's background copy and write, as every step of a long loop does."""
            if commit:
                one_step(0)
                state.commit()
            t0, c0 = time.perf_counter(), time.process_time()
            for k in range(6):
                one_step(k)
                if commit:
                    state.commit()
            t1, c1 = time.perf_counter(), time.process_time()
            state._wait_copy()
            if commit and _commit_store() is not None:
                _commit_store().flush()
            return (t1 - t0) / 6, (c1 - c0) / 6

        block(True)
        plain, committed = [], []
        for _ in range(repeats):
            plain.append(block(False))
            committed.append(block(True))
        if r == 0:  # CPU time does not depend on what else runs on the machine as much as wall time does
            print(f"COMMIT state_mb={state_mb:.1f} step_ms={median([w for w, _ in plain]) * 1e3:.3f} "
                  f"step_with_commit_ms={median([w for w, _ in committed]) * 1e3:.3f} "
                  f"cpu_ms={median([c for _, c in plain]) * 1e3:.3f} "
                  f"cpu_with_commit_ms={median([c for _, c in committed]) * 1e3:.3f}", flush=True)
        return
    train(state)
    ref = net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for x, y in data:
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    equal = all(torch.allclose(p, q, rtol=1e-5, atol=1e-6) for p, q in zip(model.parameters(), ref.parameters()))
    err = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    print(f"EQUAL rank={r} {int(equal)} max_abs_err={err:.3g}", flush=True)


def _job(np_: int, directory, *args: str, restarts: int = 1):
    """One aiaccrun job of this module's rank program; ``directory`` None: no --elastic-dir (commits kept in
    memory only)."""
    elastic = ["--max-restarts", str(restarts), "--elastic-dir", directory] if directory is not None else []
    cmd = [sys.executable, "-m", "aiacc.launcher", "-np", str(np_), *elastic,
           sys.executable, "-m", "aiacc.bench.recovery", "--as-rank", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          timeout=600)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiacc.bench recovery", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=nonneg_int, default=10, help="killed runs (0: only the commit cost)")
    p.add_argument("--np", type=positive_int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--state-mb", type=nonneg_float, default=100.0, help="state size of the commit-cost job (0: skip)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="blocks timed with and without commits, alternating (the median is reported)")
    p.add_argument("--compute", default="cpu",
                   help="the commit-cost job's training: 'cpu' (an MLP of --state-mb computed on the CPU, which "
                        "leaves no core idle here) or a replay profile (resnet50_v100: its 25.6 M parameters, "
                        "compute slept for a V100's time, so the CPU is free while layers compute, as on a GPU "
                        "node)")
    p.add_argument("--dilate", type=positive_float, default=1.0, help="with a replay profile: its compute time x this")
    p.add_argument("--as-rank", nargs=6, metavar=("KILL_RANK", "KILL_STEP", "STATE_MB", "REPEATS", "COMPUTE",
                                                  "DILATE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.as_rank:
        _rank_program(int(args.as_rank[0]), int(args.as_rank[1]), float(args.as_rank[2]), int(args.as_rank[3]),
                      args.as_rank[4], float(args.as_rank[5]))
        return 0
    from aiacc import config  # noqa: PLC0415

    if config.mpi_world_size_hint() > 1:  # (each rank ran the whole bench, the jobs timing each other)
        print("aiacc.bench recovery starts its own jobs; run it without aiaccrun", file=sys.stderr)
        return 2
    if args.compute != "cpu":
        from aiacc.bench.replay import ProfileError, load_profile  # noqa: PLC0415

        try:
            load_profile(args.compute)
        except ProfileError as exc:
            p.error(f"--compute: {exc}")
    rng = random.Random(args.seed)
    records = []
    for run in range(args.runs):
        kill_rank, kill_step = rng.randrange(args.np), rng.randrange(1, STEPS)
        with tempfile.TemporaryDirectory() as d:
            job = _job(args.np, d, str(kill_rank), str(kill_step), "0", "0", "cpu", "0")
        out = job.stdout + job.stderr
        killed = re.search(r"KILL rank=\d+ step=\d+ t=([\d.]+)", out)
        resumed = [float(t) for t in re.findall(r"RESUMED rank=\d+ step=\d+ t=([\d.]+)", out)]
        equal = re.findall(r"EQUAL rank=\d+ (\d)", out)
        ok = job.returncode == 0 and killed and resumed and len(equal) == args.np and all(e == "1" for e in equal)
        records.append(dict(run=run, kill_rank=kill_rank, kill_step=kill_step, equal=bool(ok),
                            recovery_s=(max(resumed) - float(killed.group(1))) if killed and resumed else -1.0))
        if not ok:
            print(out[-3000:], file=sys.stderr)
    emit(records, args.json, ["run", "kill_rank", "kill_step", "equal", "recovery_s"])
    good = [r["recovery_s"] for r in records if r["equal"]]
    summary = {"runs": len(records), "equal": sum(r["equal"] for r in records),
               "median_recovery_s": round(median(good), 2) if good else None}  # (null: no run recovered)
    print(json.dumps(summary) if args.json else " ".join(f"{k}={'nan' if v is None else v}" for k, v in summary.items()))
    if args.state_mb:
        for to in ("file", "memory"):  # with --elastic-dir (rank 0 writes every commit), and without
            with tempfile.TemporaryDirectory() as d:
                job = _job(2, d if to == "file" else None, "-1", "-1", str(args.state_mb), str(args.repeats),
                       args.compute, str(args.dilate), restarts=0)
            found = re.search(r"COMMIT state_mb=(\S+) step_ms=([\d.]+) step_with_commit_ms=([\d.]+) "
                              r"cpu_ms=([\d.]+) cpu_with_commit_ms=([\d.]+)", job.stdout)
            if not found:
                print(job.stdout[-2000:] + job.stderr[-2000:], file=sys.stderr)
                return 1
            state_mb = found.group(1)
            step_ms, with_commit_ms, cpu_ms, cpu_commit_ms = map(float, found.groups()[1:])
            commit = {"commit to": to, "compute": args.compute, "state_mb": float(state_mb),
                      "step_ms": round(step_ms, 1), "step_with_commit_ms": round(with_commit_ms, 1),
                      "commit_cost": round((with_commit_ms - step_ms) / step_ms, 3), "rank0_cpu_ms": round(cpu_ms, 1),
                      "rank0_cpu_with_commit_ms": round(cpu_commit_ms, 1),
                      "commit_cpu_share": round((cpu_commit_ms - cpu_ms) / cpu_ms, 3)}
            print(json.dumps(commit) if args.json else
                  f"commit to={to} compute={args.compute} state_mb={state_mb} " + " ".join(
                      f"{k}={v:.{1 if k.endswith('ms') else 3}f}" for k, v in list(commit.items())[3:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
