"""``python -m aiacc.mxnet SCRIPT [ARGS...]`` (or ``python -m aiacc.mxnet -m MODULE [ARGS...]``): runs SCRIPT as
``python SCRIPT ARGS...`` would, once ``aiacc.mxnet`` is imported. That import restores ``numpy.bool``, which
MXNet 1.9.1 needs on numpy >= 1.24, before it imports MXNet: so a script that imports ``mxnet`` before
``aiacc.mxnet`` (Horovod's MXNet examples import it first) runs unchanged::

    aiaccrun -np 2 python -m aiacc.mxnet train.py --epochs 5

Only this command changes: nothing is installed for other processes (no ``.pth`` file, no ``sitecustomize``).
``sys.argv`` and ``sys.path[0]`` are those of ``python SCRIPT``, and the script runs as ``__main__``
(``runpy``, as ``python -m mpi4py SCRIPT`` does)."""

import os
import runpy
import sys

import aiacc.mxnet  # noqa: F401 - imported first: restores numpy.bool, then imports MXNet

USAGE = "usage: python -m aiacc.mxnet SCRIPT [ARGS...] | -m MODULE [ARGS...]"


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv == ["-m"]:
        print(f"{USAGE}\n\n{__doc__}", file=sys.stderr if not argv or argv == ["-m"] else sys.stdout)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    if argv[0] == "-m":
        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()  # (python -m MODULE: the current directory first)
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # (python SCRIPT: the script's directory first)
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
