"""``python -m aiacc.bench [--link RATE [--np N]] SUBCOMMAND ...``; run under ``aiaccrun -np N``.

  --link RATE   run the subcommand on an emulated link (e.g. 1gbit, 10gbit, unlimited):
                a network namespace with a capped loopback, MPI forced onto TCP; the
                benchmark starts its own N ranks there (do not wrap it in aiaccrun)

  allreduce   engine bus bandwidth vs raw mpi4py Allreduce, 4 KiB .. 64 MiB
  fusion      1000 tensors of 4 KiB: engine vs 1000 raw calls vs one raw call
  c10d        torch.distributed on the aiacc backend vs gloo: all_reduce and DDP
  recovery    restarts after a rank is killed (not under aiaccrun): equal results, time, commit cost
  train       samples/s of a framework's training step (see aiacc.<framework>.bench)
  report      run the suite and write a markdown table and plots (--out DIR)
  replay      a compute profile (GPU per-layer times, real gradient shapes) replayed on one rank
  cluster     up/down/status/run: emulated hosts (network namespaces, tc-shaped links) for aiaccrun
  scaling     scaling and overlap efficiency of a replayed model on an emulated cluster (aiacc vs DDP)
  predict     step time and scaling efficiency at N ranks / H hosts from one step's timeline (alpha-beta)
"""

import importlib
import sys

SUBCOMMANDS = {
    "allreduce": "aiacc.bench.allreduce",
    "fusion": "aiacc.bench.fusion",
    # these import torch when they run, never at `import aiacc.bench`
    "c10d": "aiacc.bench.c10d",
    "recovery": "aiacc.bench.recovery",
    "report": "aiacc.bench.report",
    "replay": "aiacc.bench.replay",
    "cluster": "aiacc.bench.cluster",
    "scaling": "aiacc.bench.scaling",
    "predict": "aiacc.bench.predict",
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv[0] == "--link" or argv[0].startswith("--link="):
        return _on_link(argv)
    sub, rest = argv[0], argv[1:]
    if sub == "train":
        framework = None
        for i, a in enumerate(rest):
            if a == "--framework" and i + 1 < len(rest):
                framework = rest[i + 1]
            elif a.startswith("--framework="):
                framework = a.split("=", 1)[1]
        if framework is None and ("-h" in rest or "--help" in rest):
            print("usage: python -m aiacc.bench train --framework torch|tensorflow|mxnet|jax [options]\n\n"
                  "Trains the same model with aiacc and with the framework's own data parallelism, in one job.\n"
                  "Each framework has its own options: python -m aiacc.bench train --framework torch -h "
                  "(--model, --sweep-mb, --steps, --repeats, ...)")
            return 0
        if framework not in ("torch", "tensorflow", "mxnet", "jax"):
            given = "is required" if framework is None else f"{framework!r} is not one of them"
            print(f"aiacc.bench train: --framework torch|tensorflow|mxnet|jax {given} "
                  "(python -m aiacc.bench train --framework torch -h lists its options)", file=sys.stderr)
            return 2
        module = importlib.import_module(f"aiacc.bench.train_{framework}")
        return module.main(rest) or 0
    if sub not in SUBCOMMANDS:
        print(f"aiacc.bench: unknown subcommand {sub!r}; choose from allreduce, fusion, c10d, recovery, train, report, replay, cluster, scaling, predict",
              file=sys.stderr)
        return 2
    return importlib.import_module(SUBCOMMANDS[sub]).main(rest) or 0


def _on_link(argv) -> int:
    import argparse  # noqa: PLC0415

    from .common import positive_int  # noqa: PLC0415
    from .netem import LinkError, run_on_link  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="python -m aiacc.bench --link RATE")
    parser.add_argument("--link", required=True)
    parser.add_argument("--np", type=positive_int, default=2, help="ranks to start on the emulated link")
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    from .. import config  # noqa: PLC0415

    if config.mpi_world_size_hint() > 1:
        print("aiacc.bench --link starts its own ranks inside a network namespace; run it without aiaccrun",
              file=sys.stderr)
        return 2
    if not args.rest:
        parser.error("a subcommand is required after --link RATE")
    try:
        return run_on_link(args.link, args.np, args.rest)
    except LinkError as exc:
        print(f"aiacc.bench: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
