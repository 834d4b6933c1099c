"""``aiacc.init()`` and the job's size, for a process started by another launcher than aiaccrun (torchrun): prints
``SIZE rank=<torchrun's RANK> <aiacc.size()>``, or ``REFUSED rank=<RANK> <the error>`` when init refuses (caught, and
the process ends with status 0: torchrun ends the other process at once when one fails, before it says anything)."""

import os

import aiacc

try:
    aiacc.init()
except RuntimeError as err:
    os.write(1, f"REFUSED rank={os.environ.get('RANK')} {type(err).__name__}: {err}\n".encode())
else:
    os.write(1, f"SIZE rank={os.environ.get('RANK')} {aiacc.size()}\n".encode())
