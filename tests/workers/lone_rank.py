"""``aiacc.init()`` and the job's size, for a process started by another launcher than aiaccrun (torchrun): prints
``SIZE rank=<torchrun's RANK> <aiacc.size()>``."""

import os

import aiacc

aiacc.init()
os.write(1, f"SIZE rank={os.environ.get('RANK')} {aiacc.size()}\n".encode())
