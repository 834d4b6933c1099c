"""Run the benchmark suite and write a markdown report with plots.

    python -m aiacc.bench report --out DIR [--np 2] [--links shm,1gbit] [--frameworks torch,...]
                                 [--benches allreduce,fusion,train] [--from-results DIR/results.json]

Runs, each as its own job (``aiaccrun``, or ``--link`` for emulated links):
  * ``allreduce`` on every link: engine bus bandwidth beside raw MPI;
  * ``fusion`` on the default (shared-memory) link;
  * ``train`` for every framework and model on every link: samples/s of aiacc
    beside the framework's own baseline (DDP for PyTorch, ...), and the step-time
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
import shlex
import subprocess
import sys
from typing import List

from . import allreduce as allreduce_bench, fusion as fusion_bench
from .common import MODELS, add_ratios, positive_float, positive_int

BENCHES = ("allreduce", "fusion", "train")
FRAMEWORKS = ("torch", "tensorflow", "mxnet", "jax")

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


def _cell(v) -> str:
    """A table cell: floats to 3 significant digits, whole numbers from 1000 on (not ``1.06e+03``)."""
    if not isinstance(v, float):
        return str(v)
    return f"{v:.0f}" if abs(v) >= 999.5 else f"{v:.3g}"  # (999.6 to 3 digits is 1e+03 too)


def _table(records: List[dict], columns: List[str]) -> str:
    rows = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in records:
        cells = []
        for c in columns:
            v = r.get(c, "")
            cells.append(_cell(v))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


# The peer each framework's users would pick instead (vs baseline), and its tuned form where the
# bench has one (vs tuned): DDP for PyTorch, MultiWorkerMirroredStrategy for TensorFlow, MXNet's
# dist_sync kvstore (a parameter server) for MXNet, Keras' DataParallel over JAX's gloo collectives for
# Keras on JAX.
BASELINES = {"torch": "ddp", "tensorflow": "tf-mwms", "mxnet": "ps-dist_sync", "jax": "jax-dp"}
TUNED_BASELINES = {"torch": "ddp-tuned"}
TRAIN_COLUMNS = ["framework", "model", "link", "impl", "samples/s", "step ms", "compute ms", "comm ms",
                 "vs baseline", "vs tuned", "settings"]


def normalize_train(records: List[dict]) -> List[dict]:
    """The train records of every framework's bench with their ratios, computed one way.

    Every bench emits framework, model, impl, samples/s, step ms, compute ms (the same model trained
    without communication) and comm ms (step - compute). ``vs baseline`` / ``vs tuned`` are ratios of
    the medians' samples/s over the framework's peer in the same job (BASELINES, TUNED_BASELINES),
    recomputed here with :func:`aiacc.bench.common.add_ratios`, the function the benches use.
    """
    rows = [dict(r, link=r.get("link", "shm")) for r in records]
    groups = {}
    for r in rows:
        groups.setdefault((r["framework"], r["model"], r["link"]), []).append(r)
    for (framework, _, _), group in groups.items():
        add_ratios(group, BASELINES.get(framework, ""), "vs baseline")
        if framework in TUNED_BASELINES:
            add_ratios(group, TUNED_BASELINES[framework], "vs tuned")
    return rows


def _git(*args) -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        return subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _machine() -> dict:
    """What the figures were measured on: cores, CPU model, memory, and the software's versions."""
    import platform  # noqa: PLC0415
    from importlib import metadata  # noqa: PLC0415

    info = {"cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            models = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        info["cpu"] = models[0] if models else info["cpu"]
        with open("/proc/meminfo") as f:
            info["memory GiB"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    for package in ("numpy", "mpi4py", "mpich", "torch", "tensorflow", "tensorflow-cpu", "tf_keras", "keras", "mxnet",
                    "jax"):
        try:
            info[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return info


def provenance(argv: List[str]) -> dict:
    """The commit, whether the measured code differed from it, the command and the machine."""
    dirty = _git("status", "--porcelain", "--", "aiacc", "adapters", "bench")
    return {"commit": _git("rev-parse", "--short", "HEAD") or "unknown", "code changed since commit": bool(dirty),
            "command": "python -m aiacc.bench report " + " ".join(shlex.quote(a) for a in argv), "machine": _machine()}


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


BEGIN = "<!-- tables made by `python -m aiacc.bench report --readme README.md`: do not edit by hand -->"
END = "<!-- end of the tables made by the report -->"


def settings_line(meta: dict) -> str:
    """Where the figures come from: commit, command, machine."""
    if not meta:
        return "Provenance not recorded (results written before the report kept it)."
    m = meta.get("machine", {})
    versions = ", ".join(f"{k} {m[k]}" for k in ("torch", "tensorflow", "tensorflow-cpu", "tf_keras", "keras", "mxnet",
                                                 "jax", "mpich", "mpi4py") if k in m)
    changed = " (with uncommitted changes to the code!)" if meta.get("code changed since commit") else ""
    return (f"Commit `{meta.get('commit')}`{changed}; `{meta.get('command')}`; {meta.get('np')} ranks on "
            f"{m.get('cores')} cores ({m.get('cpu')}, {m.get('memory GiB')} GiB), Python {m.get('python')}, "
            f"{versions}.")


def tables(results: dict) -> List[str]:
    """The markdown tables of a results.json (shared by report.md and the README)."""
    lines = []
    allreduce, fusion, train = results.get("allreduce", []), results.get("fusion", []), results.get("train", [])
    if train:
        rows = normalize_train(train)
        cols = [c for c in TRAIN_COLUMNS if any(c in r for r in rows)]
        lines += ["**Training** (samples/s of all ranks; *vs baseline* = samples/s over the peer in the same "
                  "job: " + ", ".join(f"{k}: `{v}`" for k, v in BASELINES.items()) + "; *vs tuned* = over "
                  + ", ".join(f"`{v}`" for v in TUNED_BASELINES.values()) + "; both ratios of the medians; "
                  "*compute ms* = the same model trained without communication; *comm ms* = step - compute):",
                  "", _table(rows, cols), ""]
    if allreduce:
        lines += ["**Allreduce** (float32 Sum in place, `aiacc.allreduce_`; raw = mpi4py `Allreduce(IN_PLACE)` "
                  "in the same job; bus bandwidth = 2(n-1)/n x bytes / time; *aiacc_vs_raw* = raw time / aiacc's "
                  "time: above 1, aiacc is faster):", "",
                  _table(allreduce, ["link"] + allreduce_bench.COLUMNS), ""]
    if fusion:
        lines += ["**1000 small tensors** (named `allreduce_async_` + `synchronize`; raw_each = 1000 raw calls; "
                  "raw_fused = one raw call of all the bytes; grouped = one `grouped_allreduce_` of the list; "
                  "*_vs_raw_\\** = aiacc's time / raw time: below 1, aiacc is faster):", "",
                  _table(fusion, fusion_bench.COLUMNS), ""]
    return lines


def markdown(results: dict, plots: List[str] = ()) -> str:
    """report.md of a results.json."""
    meta = results.get("meta", {})
    links = meta.get("links") or sorted({r.get("link", "shm") for r in results.get("train", [])})
    lines = ["# aiacc benchmark report", "", settings_line(meta), "",
             f"Links: {', '.join(links)} (shm = one machine, MPI over shared memory; others = emulated link, "
             "see `--link`).", ""]
    for link, env in sorted(meta.get("link settings", {}).items()):
        lines += [f"Settings on {link}: " + ", ".join(f"`{k}={v}`" for k, v in sorted(env.items())), ""]
    lines += tables(results)
    lines += [f"![{p_}]({p_})" if p_.endswith(".png") else p_ for p_ in plots]
    return "\n".join(lines) + "\n"


def readme_block(results: dict) -> str:
    """The README's generated part: provenance and tables, between the BEGIN and END markers."""
    return "\n".join([BEGIN, "", settings_line(results.get("meta", {})), "", *tables(results), END])


def replace_block(text: str, block: str, where: str = "README.md") -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{where} has no generated block: put these two lines where the tables go:\n{BEGIN}\n{END}")
    head, rest = text.split(BEGIN, 1)
    return head + block + rest.split(END, 1)[1]


def current_block(text: str) -> str:
    """The generated block as it stands in a README."""
    return BEGIN + text.split(BEGIN, 1)[1].split(END, 1)[0] + END


def _with_block(text: str, where: str) -> str:
    replace_block(text, "", where)  # (its error when the markers are missing)
    return text


def _load_results(f) -> dict:
    """A results.json, read as the report reads it (every record), or the error saying what is wrong."""
    saved = json.load(f)
    if not isinstance(saved, dict) or not all(isinstance(saved.get(k), list) for k in BENCHES):
        raise ValueError(f"not a results.json of aiacc.bench report (lists {', '.join(BENCHES)})")
    markdown(saved)
    readme_block(saved)
    return saved


def _checked_file(p: argparse.ArgumentParser, flag: str, path, load):
    """``load(file)`` of ``path`` (None without one), or the parser's error naming ``flag``, ``path`` and what was
    wrong: checked before any job runs."""
    if not path:
        return None
    try:
        with open(path) as f:
            return load(f)
    except SystemExit as exc:  # (replace_block's)
        p.error(f"{flag} {str(exc)}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        p.error(f"{flag} {path!r}: {getattr(exc, 'strerror', None) or repr(exc)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiacc.bench report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for report.md, results.json and the plots")
    p.add_argument("--np", type=positive_int, default=2)
    p.add_argument("--links", default="shm,1gbit", help="comma-separated: shm (no emulation), unlimited, 1gbit, ...")
    p.add_argument("--frameworks", default="torch,tensorflow,mxnet,jax")
    p.add_argument("--models", default="cnn,transformer,narrow")
    p.add_argument("--train-args", default="", help="extra arguments for every train job (one string)")
    p.add_argument("--timeout", type=positive_float, default=1800, help="seconds per job")
    p.add_argument("--benches", default="allreduce,fusion,train", help="which benches to run (comma-separated)")
    p.add_argument("--from-results", metavar="JSON",
                   help="run nothing: write the report and plots again from an earlier results.json")
    p.add_argument("--readme", metavar="README.md",
                   help="also write the tables into this file, between its generated-block markers")
    p.add_argument("--env-for", action="append", default=[], metavar="LINK:VAR=VALUE",
                   help="set VAR for every job on LINK (e.g. 1gbit:AIACC_PARTITION_BYTES=256KiB); repeatable")
    args = p.parse_args(argv)
    from .. import config  # noqa: PLC0415

    if config.mpi_world_size_hint() > 1:
        print("aiacc.bench report starts its own jobs; run it without aiaccrun", file=sys.stderr)
        return 2
    # everything a typo could spoil is checked before any job runs (a mistyped --benches ran nothing and wrote
    # empty tables into the README; a README without the markers was emptied; a bad --from-results a traceback)
    for flag, given, known in (("--benches", args.benches, BENCHES), ("--frameworks", args.frameworks, FRAMEWORKS),
                               ("--models", args.models, sorted(MODELS))):
        names = [x for x in given.split(",") if x]
        bad = [x for x in names if x not in known]
        if bad or not names:
            p.error(f"{flag} {given!r}: {'unknown ' + repr(bad[0]) if bad else 'empty'}; choose from "
                    f"{', '.join(known)}")
    readme = _checked_file(p, "--readme", args.readme, lambda f: _with_block(f.read(), args.readme))
    saved = _checked_file(p, "--from-results", args.from_results, _load_results)
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as exc:
        p.error(f"--out {args.out!r}: {exc.strerror}")
    if not os.access(args.out, os.W_OK | os.X_OK):
        p.error(f"--out {args.out!r}: not writable")
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
    if saved is not None:
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

    if args.from_results:
        meta = saved.get("meta", {})
    else:
        meta = dict(provenance(list(argv if argv is not None else sys.argv[1:])), np=args.np, links=links,
                    **{"link settings": link_env, "train args": args.train_args})
    results = {"meta": meta, "allreduce": allreduce, "fusion": fusion, "train": train}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    plots = _plots(args.out, allreduce, normalize_train(train))
    text = markdown(results, plots)
    if failures:
        text += "\n## jobs that failed\n\n"
        for label, code, tail in failures:
            text += f"### {label} (exit status {code})\n\n```\n{tail}\n```\n\n"
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(text)
    print(f"[report] wrote {os.path.join(args.out, 'report.md')}", flush=True)
    if readme is not None:
        text = replace_block(readme, readme_block(results), args.readme)  # (built before the file is opened)
        with open(args.readme, "w") as f:
            f.write(text)
        print(f"[report] wrote the tables of {args.readme}", flush=True)
    return 1 if failures else 0
