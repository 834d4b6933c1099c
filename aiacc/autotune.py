"""Online tuning of fusion threshold, cycle time and partition size (``AIACC_AUTOTUNE=1``).

Steps without help from the framework: a training step allreduces the same
gradient names once, so the number of times one *marker* name (the first named
allreduce agreed a second time, but for the one-time agreement of gradient
buckets: not a name agreed once before training, nor a loss logged every K
steps) has been agreed is the number of steps. Unnamed allreduces get a new name each
call: a script of those only is not tuned (a warning says so). Responses
are identical on every rank, so every rank reaches the k-th step in the same
engine cycle; there, rank 0's measurement is broadcast and every rank applies
the same next setting in the same cycle (fusion plans and partitions must be
identical everywhere).

Search: coordinate descent from the configured values. For each knob in turn
(fusion threshold, cycle time, partition size; a knob the user set through a
variable or a flag is held constant, as in Horovod), each candidate runs
``warmup_steps`` unmeasured then ``steps_per_sample`` measured steps; the best
score (steps per second on rank 0) wins and the next knob is tuned with it.
With the default 3 + 5 steps per sample and 4 + 4 + 3 candidates, the tuner
settles after at most 11 samples = 88 steps (from the second), then keeps the best setting. Every
trial and the choice go to the ``aiacc.autotune`` logger (info) and, with
``AIACC_AUTOTUNE_LOG``, to a CSV file.
"""

from __future__ import annotations

import logging
import os
import time
from typing import List, Optional, Tuple

import numpy as np

from .names import BUCKET_SETUP_PREFIX
from .ops import Collective

logger = logging.getLogger(__name__)

__all__ = ["Autotuner", "CANDIDATES"]

MiB = 1 << 20
CANDIDATES = {
    "fusion_threshold": [1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB],
    "cycle_time_ms": [0.5, 1.0, 2.0, 5.0],
    "partition_bytes": [0, 1 * MiB, 4 * MiB],
}
KNOBS = ("fusion_threshold", "cycle_time_ms", "partition_bytes")
UNNAMED = ".noname."  # in the names the engine gives unnamed collectives (one per call)
UNNAMED_WARN = 1000  # unnamed allreduces before the warning that nothing can be tuned


class Autotuner:
    """Lives in the engine thread; ``on_cycle`` is called once per engine cycle with its responses."""

    def __init__(self, engine, config):
        self.engine = engine
        self.warmup = config.autotune_warmup_steps
        self.per_sample = config.autotune_steps_per_sample
        self.current = {
            "fusion_threshold": config.fusion_threshold,
            "cycle_time_ms": config.cycle_time_ms,
            "partition_bytes": config.partition_bytes,
        }
        self.best = dict(self.current)
        self.best_score = -1.0
        # the knobs the user left at their defaults on every rank (Horovod holds those set explicitly constant)
        fixed = getattr(engine, "fixed_knobs", getattr(config, "explicit", ()))
        self.knobs = [k for k in KNOBS if k not in fixed]
        self.knob_index = 0
        self.queue: List[Tuple[str, object]] = self._candidates(self.knobs[0]) if self.knobs else []
        self.marker: Optional[str] = None
        self.seen: set = set()  # the named allreduces agreed so far, until one comes round again: the marker
        self.unnamed = 0
        self.steps = 0
        self.sample_start_step = 0
        self.sample_t0 = 0.0
        self.samples = 0
        self.done = False
        self.log_file = None
        if config.autotune_log and engine.rank == 0:
            # (its folder made, as the timeline's: a new folder of the run's name was "No such file or directory")
            os.makedirs(os.path.dirname(os.path.abspath(config.autotune_log)), exist_ok=True)
            self.log_file = open(config.autotune_log, "w")  # noqa: SIM115 - closed in close()
            self.log_file.write("sample,knob,fusion_threshold,cycle_time_ms,partition_bytes,steps,seconds,"
                                "steps_per_second\n")
        if not self.queue:  # every knob set by the user: nothing to tune
            self.done = True
            self._log("fixed", 0.0, 0.0)
            return
        self._apply(self._next_setting())

    def _candidates(self, knob: str) -> List[Tuple[str, object]]:
        return [(knob, v) for v in CANDIDATES[knob]]

    def _next_setting(self) -> dict:
        knob, value = self.queue[0]
        setting = dict(self.best)
        setting[knob] = value
        return setting

    def _apply(self, setting: dict) -> None:
        self.current = setting
        self.engine.tune(setting["fusion_threshold"], setting["cycle_time_ms"], setting["partition_bytes"])

    # ---- called by the engine thread ---------------------------------------------------
    def on_cycle(self, responses) -> None:
        if self.done or not responses:
            return
        for resp in responses:
            if resp.error is None and resp.meta.kind == Collective.ALLREDUCE:
                if self.marker is None:  # the second step: where the first sample's steps are counted from
                    if not self._may_mark(resp.name):
                        continue
                    if resp.name not in self.seen:  # (once so far: a step's, or one agreed once before training)
                        if len(self.seen) >= 1 << 16:
                            self.seen.clear()
                        self.seen.add(resp.name)
                        continue
                    self.marker, self.seen = resp.name, set()
                    self.sample_start_step = 1
                if resp.name == self.marker:
                    self._on_step()
                    if self.done:
                        return

    def _may_mark(self, name: str) -> bool:
        """Whether ``name`` comes round once a step: not the buckets' one-time agreement, not an unnamed call."""
        if name.startswith(BUCKET_SETUP_PREFIX):
            return False
        if UNNAMED in name:
            self.unnamed += 1
            if self.unnamed == UNNAMED_WARN and self.engine.rank == 0:
                logger.warning("aiacc autotune: %d allreduces without a name and none with one: the steps cannot be "
                               "told apart, so nothing is tuned; give the tensors names (name=...)", self.unnamed)
            return False
        return True

    def _on_step(self) -> None:
        self.steps += 1
        in_sample = self.steps - self.sample_start_step
        if in_sample == self.warmup:
            self.sample_t0 = time.perf_counter()
        elif in_sample == self.warmup + self.per_sample:
            self._finish_sample(time.perf_counter() - self.sample_t0)

    def _finish_sample(self, seconds: float) -> None:
        # every rank is in this same cycle: rank 0's measurement decides for all
        score = np.array([self.per_sample / seconds if seconds > 0 else 0.0], np.float64)
        self.engine.transport.broadcast(score, 0)
        score = float(score[0])
        knob, _ = self.queue.pop(0)
        self.samples += 1
        self._log(knob, seconds, score)
        if score > self.best_score:
            self.best_score = score
            self.best = dict(self.current)
        if not self.queue:
            self.knob_index += 1
            if self.knob_index < len(self.knobs):
                self.queue = self._candidates(self.knobs[self.knob_index])
        if self.queue:
            self._apply(self._next_setting())
        else:
            self._apply(self.best)
            self.done = True
            self._log("chosen", 0.0, self.best_score)
            if self.engine.rank == 0:  # (every rank chose the same: rank 0 says so, as for each trial)
                logger.info("aiacc autotune chose fusion_threshold=%d cycle_time_ms=%g partition_bytes=%d "
                            "(%.2f steps/s) after %d samples, %d steps", self.best["fusion_threshold"],
                            self.best["cycle_time_ms"], self.best["partition_bytes"], self.best_score,
                            self.samples, self.steps)
        self.sample_start_step = self.steps
        self.sample_t0 = time.perf_counter()  # the next sample's clock, with no warmup steps (else set after them)

    def _log(self, knob: str, seconds: float, score: float) -> None:
        s = self.current  # for "chosen": the best, applied just before
        if self.engine.rank == 0:
            logger.info("aiacc autotune %s: fusion_threshold=%d cycle_time_ms=%g partition_bytes=%d -> %.3f steps/s",
                        knob, s["fusion_threshold"], s["cycle_time_ms"], s["partition_bytes"], score)
        if self.log_file is not None:
            steps = self.steps if knob in ("chosen", "fixed") else self.per_sample
            self.log_file.write(f"{self.samples},{knob},{s['fusion_threshold']},{s['cycle_time_ms']},"
                                f"{s['partition_bytes']},{steps},{seconds:.6f},{score:.6f}\n")
            self.log_file.flush()

    def close(self) -> None:
        if self.log_file is not None:
            self.log_file.close()
            self.log_file = None
