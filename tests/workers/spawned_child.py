"""A rank that starts a process with multiprocessing's 'spawn' start method (as a torch DataLoader with
``multiprocessing_context="spawn"`` does). argv: ``toplevel`` (``aiacc.init()`` at the script's top level, the common
mistake: the child runs it again while it imports the script) or ``guarded`` (init under ``__main__``; the child asks
for its rank). Each rank prints ``CHILD rank=<r> exitcode=<c>`` and, guarded, the child prints the error it got."""

import multiprocessing
import os
import sys

import aiacc

mode = sys.argv[1]
if mode == "toplevel":
    aiacc.init()


def child():
    try:
        aiacc.rank()
    except aiacc.AiaccError as err:
        os.write(1, f"CHILD error: {type(err).__name__}: {err}\n".encode())


if __name__ == "__main__":
    if mode == "guarded":
        aiacc.init()
    process = multiprocessing.get_context("spawn").Process(target=child)
    process.start()
    process.join(60)
    os.write(1, f"CHILD rank={aiacc.rank()} exitcode={process.exitcode}\n".encode())
    aiacc.barrier()
    os.write(1, f"OK rank={aiacc.rank()}\n".encode())
