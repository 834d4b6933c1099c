"""Run the benchmark suite and write a markdown report with plots.

    python -m aiacc.bench report --out DIR [--np 2] [--links shm,1gbit] [--frameworks torch,...]
                                 [--benches allreduce,fusion,train] [--from-results DIR/results.json]

Runs, each as its own job (``aiaccrun``, or ``--link`` for emulated links):
  * ``allreduce`` on every link: engine bus bandwidth beside raw MPI;
  * ``fusion`` on the default (shared-memory) link;
  * ``train`` for every framework and model on every link: samples/s of aiacc
    beside the framework's own baseline (DDP for PyTorch), and the step-time
    breakdown (compute alone vs with communication).
Writes ``DIR/report.md`` (tables), ``DIR/results.json`` (every record),
``DIR/busbw.png``, ``DIR/train.png`` and ``DIR/breakdown.png``. A job that
fails is reported in the markdown with its exit status and last lines; the
rest of the suite still runs. Do not start it under aiaccrun.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import List

from . import allreduce as allreduce_bench, fusion as fusion_bench

__all__ = ["main"]


def _job(cmd: List[str], timeout: float, extra_env=None) -> tuple:
    env = dict(os.environ)
    env.update(extra_env or {})
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        code, text = out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired as exc:
        code, text = 124, f"timed out after {timeout:.0f} s\n{exc.stdout or ''}"
    records = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return code, text, records


def _bench_cmd(link: str, np: int, args: List[str]) -> List[str]:
    if link == "shm":
        return [sys.executable, "-m", "aiacc.launcher", "-np", str(np), sys.executable, "-m", "aiacc.bench", *args]
    return [sys.executable, "-m", "aiacc.bench", "--link", link, "--np", str(np), *args]


def _table(records: List[dict], columns: List[str]) -> str:
    rows = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in records:
        cells = []
        for c in columns:
            v = r.get(c, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


# Each framework's train bench names its baseline run: DDP for PyTorch, the blocking (no-overlap)
# tape for TensorFlow, MXNet's own dist_sync kvstore.
BASELINES = {"torch": "ddp", "tensorflow": "blocking", "mxnet": "mxnet-dist_sync"}


def normalize_train(records: List[dict]) -> List[dict]:
    """One schema for the train records of every framework's bench.

    Fields: framework, model, link, impl, samples/s, step ms, compute ms (the same model and link
    trained without communication), comm ms (step - compute) and vs baseline (samples/s over the
    framework's baseline run in the same job, see BASELINES).
    """
    rows = []
    for r in records:
        row = dict(r)
        row["impl"] = r.get("impl") or r.get("mode") or "?"
        row["samples/s"] = r.get("samples/s", r.get("samples_per_s"))
        row["step ms"] = r.get("step ms", r.get("step_ms", r.get("ms/step")))
        rows.append(row)
    key = lambda r: (r["framework"], r["model"], r.get("link", "shm"))  # noqa: E731
    compute = {key(r): r["step ms"] for r in rows if r["impl"] == "compute"}
    base = {key(r): r["samples/s"] for r in rows if r["impl"] == BASELINES.get(r["framework"])}
    for r in rows:
        if "compute ms" not in r and key(r) in compute and r["impl"] != "compute":
            r["compute ms"] = compute[key(r)]
            r["comm ms"] = r["step ms"] - r["compute ms"]
        if "vs ddp" in r:  # the torch bench's own figure: the median of paired ratios, steadier
            r["vs baseline"] = r["vs ddp"]
        elif key(r) in base and r["impl"] != "compute" and r["samples/s"]:
            r["vs baseline"] = r["samples/s"] / base[key(r)]
    return rows


def _plots(out: str, allreduce: List[dict], train: List[dict]) -> List[str]:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return ["(plots skipped: matplotlib is not installed; pip install 'aiacc[bench]')"]
    made = []
    if allreduce:
        fig, ax = plt.subplots(figsize=(7, 4))
        for link in sorted({r["link"] for r in allreduce}):
            rs = sorted((r for r in allreduce if r["link"] == link), key=lambda r: r["bytes"])
            ax.plot([r["bytes"] for r in rs], [r["aiacc_busbw_GBps"] for r in rs], "o-", label=f"aiacc ({link})")
            ax.plot([r["bytes"] for r in rs], [r["raw_busbw_GBps"] for r in rs], "s--", label=f"raw MPI ({link})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title("allreduce bus bandwidth, 2(n-1)/n x bytes / time")
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "busbw.png"), dpi=120)
        plt.close(fig)
        made.append("busbw.png")
    if train:
        groups = sorted({(r["framework"], r["model"], r["link"]) for r in train})
        impls = sorted({r["impl"] for r in train if r["impl"] != "compute"})
        fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(groups)), 4))
        width = 0.8 / max(1, len(impls))
        for i, impl in enumerate(impls):
            xs, ys = [], []
            for g, key in enumerate(groups):
                for r in train:
                    if (r["framework"], r["model"], r["link"]) == key and r["impl"] == impl:
                        xs.append(g + i * width)
                        ys.append(r["samples/s"])
            ax.bar(xs, ys, width, label=impl)
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
        ax.set_xticklabels([f"{f}\n{m}\n{link}" for f, m, link in groups], fontsize=8)
        ax.set_ylabel("samples/s (all ranks)")
        ax.set_title("training throughput")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out, "train.png"), dpi=120)
        plt.close(fig)
        made.append("train.png")
        rows = [r for r in train if "compute ms" in r and r["impl"] != "compute"]
        if rows:
            fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(rows)), 4))
            labels = [f"{r['framework']}/{r['model']}\n{r['link']}\n{r['impl']}" for r in rows]
            compute = [r["compute ms"] for r in rows]
            comm = [max(0.0, r["step ms"] - r["compute ms"]) for r in rows]
            ax.bar(range(len(rows)), compute, label="compute alone")
            ax.bar(range(len(rows)), comm, bottom=compute, label="added by communication")
            ax.set_xticks(range(len(rows)))
            ax.set_xticklabels(labels, fontsize=7)
            ax.set_ylabel("ms per step")
            ax.set_title("step-time breakdown")
            ax.legend()
            fig.tight_layout()
            fig.savefig(os.path.join(out, "breakdown.png"), dpi=120)
            plt.close(fig)
            made.append("breakdown.png")
    return made


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiacc.bench report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for report.md, results.json and the plots")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--links", default="shm,1gbit", help="comma-separated: shm (no emulation), unlimited, 1gbit, ...")
    p.add_argument("--frameworks", default="torch,tensorflow,mxnet")
    p.add_argument("--models", default="cnn,transformer,narrow")
    p.add_argument("--train-args", default="", help="extra arguments for every train job (one string)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per job")
    p.add_argument("--benches", default="allreduce,fusion,train", help="which benches to run (comma-separated)")
    p.add_argument("--from-results", metavar="JSON",
                   help="run nothing: write the report and plots again from an earlier results.json")
    p.add_argument("--env-for", action="append", default=[], metavar="LINK:VAR=VALUE",
                   help="set VAR for every job on LINK (e.g. 1gbit:AIACC_PARTITION_BYTES=256KiB); repeatable")
    args = p.parse_args(argv)
    from .. import config  # noqa: PLC0415

    if config.mpi_world_size_hint() > 1:
        print("aiacc.bench report starts its own jobs; run it without aiaccrun", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    links = [s for s in args.links.split(",") if s]
    failures, allreduce, fusion, train = [], [], [], []
    link_env = {}
    for item in args.env_for:
        link, _, assignment = item.partition(":")
        var, _, value = assignment.partition("=")
        if not var or not _:
            p.error(f"--env-for {item!r}: expected LINK:VAR=VALUE")
        link_env.setdefault(link, {})[var] = value

    def run(label, cmd, link="shm"):
        print(f"[report] {label}: {' '.join(cmd[-8:])}", flush=True)
        code, text, records = _job(cmd, args.timeout, link_env.get(link))
        if code != 0 or not records:
            failures.append((label, code, "\n".join(text.strip().splitlines()[-15:])))
        return records

    benches = {b for b in args.benches.split(",") if b}
    if args.from_results:
        with open(args.from_results) as f:
            saved = json.load(f)
        allreduce, fusion, train = saved["allreduce"], saved["fusion"], saved["train"]
        links = sorted({r.get("link", "shm") for r in allreduce + train}, key=lambda x: (x != "shm", x))
        benches = set()
    if "allreduce" in benches:
        for link in links:
            extra = [] if link == "shm" else ["--max-bytes", "16MiB"]
            for r in run(f"allreduce {link}", _bench_cmd(link, args.np, ["allreduce", "--json", *extra]), link):
                r["link"] = link
                allreduce.append(r)
    if "fusion" in benches:
        fusion += run("fusion shm", _bench_cmd("shm", args.np, ["fusion", "--json"]))
    if "train" in benches:
        for fw in [f for f in args.frameworks.split(",") if f]:
            for model in [m for m in args.models.split(",") if m]:
                for link in links:
                    cmd = _bench_cmd(link, args.np, ["train", "--framework", fw, "--model", model, "--json",
                                                     *args.train_args.split()])
                    for r in run(f"train {fw} {model} {link}", cmd, link):
                        r["link"] = link
                        train.append(r)

    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"allreduce": allreduce, "fusion": fusion, "train": train}, f, indent=1)
    train = normalize_train(train)
    plots = _plots(args.out, allreduce, train)
    lines = ["# aiacc benchmark report", "", f"{args.np} ranks; links: {', '.join(links)} "
             "(shm = one machine, MPI over shared memory; others = emulated link, see `--link`).", ""]
    for link, env in sorted(link_env.items()):
        lines += [f"Settings on {link}: " + ", ".join(f"`{k}={v}`" for k, v in sorted(env.items())), ""]
    if allreduce:
        lines += ["## allreduce (float32, Sum, in place)", "",
                  _table(allreduce, ["link"] + allreduce_bench.COLUMNS), ""]
    if fusion:
        lines += ["## 1000 small tensors", "",
                  _table(fusion, fusion_bench.COLUMNS),
                  "", "grouped = the same list as one `grouped_allreduce` (one name, one handle).", ""]
    if train:
        cols = ["framework", "model", "link", "impl", "samples/s", "step ms", "compute ms", "comm ms"]
        cols += [c for c in ("vs baseline", "overlap %") if any(c in r for r in train)]
        lines += ["## training throughput", "",
                  "compute = the same model trained without communication; vs baseline = samples/s over "
                  + ", ".join(f"{k}: {v}" for k, v in BASELINES.items()) + " (same job).", "",
                  _table(train, cols), ""]
    lines += [f"![{p_}]({p_})" if p_.endswith(".png") else p_ for p_ in plots]
    if failures:
        lines += ["", "## jobs that failed", ""]
        for label, code, tail in failures:
            lines += [f"### {label} (exit status {code})", "", "```", tail, "```", ""]
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"[report] wrote {os.path.join(args.out, 'report.md')}", flush=True)
    return 1 if failures else 0
