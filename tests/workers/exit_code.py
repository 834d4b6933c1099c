"""Rank r exits with status EXIT[r] after a collective (tests aiaccrun's exit status)."""

import sys

import numpy as np

import aiacc
from report import say

aiacc.init()
codes = [int(c) for c in sys.argv[1].split(",")]
cfg = aiacc.get_engine().config
aiacc.allreduce(np.ones(1), name="x")
say(f"OK rank={aiacc.rank()} cycle_time_ms={cfg.cycle_time_ms} fusion={cfg.fusion_threshold} size={aiacc.size()}")
rank = aiacc.rank()
aiacc.shutdown()
sys.exit(codes[rank])
