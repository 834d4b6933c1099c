"""``python -m aiacc.bench SUBCOMMAND ...``; run under ``aiaccrun -np N``.

  allreduce   engine bus bandwidth vs raw mpi4py Allreduce, 4 KiB .. 64 MiB
  fusion      1000 tensors of 4 KiB: engine vs 1000 raw calls vs one raw call
  train       samples/s of a framework's training step (see aiacc.<framework>.bench)
  report      run the suite and write a markdown table and plots (--out DIR)
"""

import importlib
import sys

SUBCOMMANDS = {
    "allreduce": "aiacc.bench.allreduce",
    "fusion": "aiacc.bench.fusion",
    "report": "aiacc.bench.report",
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    sub, rest = argv[0], argv[1:]
    if sub == "train":
        framework = None
        for i, a in enumerate(rest):
            if a == "--framework" and i + 1 < len(rest):
                framework = rest[i + 1]
            elif a.startswith("--framework="):
                framework = a.split("=", 1)[1]
        if framework not in ("torch", "tensorflow", "mxnet"):
            print("aiacc.bench train: --framework torch|tensorflow|mxnet is required", file=sys.stderr)
            return 2
        module = importlib.import_module(f"aiacc.{framework}.bench")
        return module.main(rest) or 0
    if sub not in SUBCOMMANDS:
        print(f"aiacc.bench: unknown subcommand {sub!r}; choose from allreduce, fusion, train, report",
              file=sys.stderr)
        return 2
    return importlib.import_module(SUBCOMMANDS[sub]).main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
