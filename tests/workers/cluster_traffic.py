"""On an emulated cluster: which bytes cross the host's shaped link, and correct allreduces.

Reads this host's link counters (eth0 inside the host's network namespace) around two phases:
1. ranks of the same host exchange INTRA bytes (mpi4py Sendrecv with the host neighbour): shared
   memory, so the link must stay (almost) quiet;
2. an aiacc allreduce of CROSS bytes over every rank: the link must carry them;
3. the same allreduce with Compression.fp16: the link carries half as much.
Prints ``OK rank=R host=ADDR local=L/LS cross=C/CS intra_link_bytes=... allreduce_link_bytes=...
fp16_link_bytes=...``.
Usage: cluster_traffic.py HOSTS RANKS_PER_HOST
"""

import os
import sys

import numpy as np
from mpi4py import MPI

import aiacc
from report import say

HOSTS, PER_HOST = int(sys.argv[1]), int(sys.argv[2])
INTRA = CROSS = 16 << 20
aiacc.init()
r, n = aiacc.rank(), aiacc.size()
comm = MPI.COMM_WORLD
assert n == HOSTS * PER_HOST
# MPICH's nodes are hydra's proxies, one per emulated host; ranks fill the hosts in order
assert (aiacc.local_rank(), aiacc.local_size()) == (r % PER_HOST, PER_HOST), (aiacc.local_rank(), aiacc.local_size())
if aiacc.local_rank() == 0:
    assert (aiacc.cross_rank(), aiacc.cross_size()) == (r // PER_HOST, HOSTS)


def link_bytes() -> int:
    total = 0
    for what in ("tx_bytes", "rx_bytes"):
        with open(f"/sys/class/net/eth0/statistics/{what}") as f:
            total += int(f.read())
    return total


comm.Barrier()
before = link_bytes()
if PER_HOST > 1:
    peer = r ^ 1 if (r ^ 1) // PER_HOST == r // PER_HOST else r
    send = np.full(INTRA // 4, r, np.float32)
    recv = np.empty_like(send)
    comm.Sendrecv(send, dest=peer, recvbuf=recv, source=peer)
    assert recv[0] == peer and recv[-1] == peer
comm.Barrier()
intra = link_bytes() - before

comm.Barrier()
before = link_bytes()
x = np.full(CROSS // 4, r + 1.0, np.float32)
y = aiacc.allreduce(x, op=aiacc.Sum, name="cluster.x")
assert np.array_equal(y, np.full_like(x, n * (n + 1) / 2)), y[:4]
comm.Barrier()
cross = link_bytes() - before

comm.Barrier()
before = link_bytes()
z = aiacc.allreduce(x, op=aiacc.Sum, name="cluster.x16", compression=aiacc.Compression.fp16)
assert z.dtype == np.float32 and np.array_equal(z, y), z[:4]
comm.Barrier()
cross16 = link_bytes() - before
hier = aiacc.get_engine().executor.hierarchy is not None
say(f"OK rank={r} host={os.environ.get('PMI_HOSTNAME')} local={aiacc.local_rank()}/{aiacc.local_size()} "
    f"cross={aiacc.cross_rank()}/{aiacc.cross_size()} hierarchical={hier} intra_link_bytes={intra} "
    f"allreduce_link_bytes={cross} fp16_link_bytes={cross16}")
aiacc.shutdown()
