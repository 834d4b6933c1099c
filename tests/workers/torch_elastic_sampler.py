"""hvd.elastic.ElasticSampler (Horovod's) on 2 or more ranks.

* Sharing out: each rank gets every n-th index of the epoch's order (``random.Random(seed + epoch)``, the
  same on every rank), padded so that all get as many; ``record_batch`` counts the samples of all ranks.
* In a TorchState: ``restore()`` goes back to the saved (committed) position and shares out what is left from
  there, ``sync()`` gives every rank rank 0's position, ``set_epoch`` starts a new order.
* Across a restart (``aiaccrun --max-restarts 1 --elastic-dir DIR``): rank 1 raises after FAIL_AT batches
  of epoch 0 on the first start; the job resumes from the last commit with the sampler's position, and
  each rank prints the indices of every batch it processed (``BATCH ...``) so that the test can check that
  the batches committed on the first start and those of the second cover the epoch, none twice.

Usage: torch_elastic_sampler.py FAIL_AT
"""

import random
import sys

import torch
import torch.utils.data

import aiacc.torch as hvd
from report import say

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
FAIL_AT = int(sys.argv[1])
start = hvd.elastic.restart_count()
checks = 0


def order(size, seed, epoch):
    indices = list(range(size))
    random.Random(seed + epoch).shuffle(indices)
    return indices


def share(indices):
    """This rank's share of ``indices``: every n-th, after repeating the first ones up to a multiple of n."""
    padded = indices + indices[:-len(indices) % n]
    return padded[r::n]


# ---- sharing out, restore, sync, set_epoch (every start) -------------------------------------------------
# (imported as Horovod's examples do, from the modules of its elastic package: an ImportError before)
from aiacc.torch.elastic.sampler import ElasticSampler  # noqa: E402
from aiacc.torch.elastic.state import TorchState  # noqa: E402

assert ElasticSampler is hvd.elastic.ElasticSampler is hvd.elastic.sampler.ElasticSampler
assert TorchState is hvd.elastic.TorchState is hvd.elastic.state.TorchState
data = list(range(21))
sampler = ElasticSampler(data, shuffle=True, seed=5)
state = TorchState(sampler=sampler)
state.sync()
assert list(sampler) == share(order(21, 5, 0)) and len(sampler) == -(-21 // n), list(sampler)  # 2 ranks: one repeated
sampler.record_batch(0, 3)
assert sampler.processed_num == 3 * n
state.save()  # (commit() without writing to the elastic directory, which the restart below uses)
sampler.record_batch(1, 3)
state.restore()
done = 3 * n  # (the saved position)
assert sampler.processed_num == done and list(sampler) == share(order(21, 5, 0)[done:]) and \
    len(sampler) == -(-(21 - done) // n), list(sampler)
checks += 3
if r == 1:  # a rank that went further: sync gives it rank 0's position
    sampler.record_batch(2, 3)
state.sync()
assert sampler.processed_num == done and list(sampler) == share(order(21, 5, 0)[done:]), \
    (sampler.processed_num, list(sampler))
sampler.set_epoch(1)
assert sampler.processed_num == 0 and list(sampler) == share(order(21, 5, 1))
assert list(hvd.elastic.ElasticSampler(data, shuffle=False)) == share(list(range(21)))
checks += 3

# ---- across a restart -------------------------------------------------------------------------------------
SIZE, BS = 22, 2
dataset = list(range(SIZE))
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=11)
loader = torch.utils.data.DataLoader(dataset, batch_size=BS, sampler=sampler)
state = hvd.elastic.TorchState(sampler=sampler, epoch=0)


@hvd.elastic.run
def train(state):
    say(f"RESUME rank={r} start={start} epoch={state.epoch} processed={sampler.processed_num}")
    for state.epoch in range(state.epoch, 2):
        for i, batch in enumerate(loader):
            hvd.allreduce(torch.tensor([float(len(batch))]), name="batch")  # the ranks step together
            say(f"BATCH rank={r} start={start} epoch={state.epoch} idx={','.join(map(str, batch.tolist()))}")
            sampler.record_batch(i, BS)
            state.commit()
            if start == 0 and r == 1 and state.epoch == 0 and i + 1 == FAIL_AT:
                raise RuntimeError(f"planned failure after {FAIL_AT} batches")
        sampler.set_epoch(state.epoch + 1)
        state.commit()


train(state)
checks += 1
say(f"OK rank={r} start={start} checks={checks}")
