"""The stall inspector: names the ranks that have not submitted a tensor others wait for.

Every rank asks for a check (a bit of the negotiation) once its oldest waiting
request is older than the limit; the check itself is collective (every rank
reports its waiting names and their ages), so the report, and the decision to
end the job, are the same on every rank.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from .exceptions import AiaccError, StallError, TensorMismatchError
from .names import BUCKET_SETUP_PREFIX

logger = logging.getLogger(__name__)

__all__ = ["StallInspector"]


class StallInspector:
    """``check_seconds``: warn after this long (0: never); ``shutdown_seconds``: end every rank with a
    :class:`StallError` after this long (0: never)."""

    def __init__(self, rank: int, check_seconds: float, shutdown_seconds: float, job_rank: Optional[int] = None,
                 shutdown_variable: str = "AIACC_STALL_SHUTDOWN_SECONDS", where: str = ""):
        """``rank``: within the engine's ranks (rank 0 logs the collective reports); ``job_rank``: the rank
        in the job that messages name (a process set's engine), default ``rank``; ``shutdown_variable``: the
        variable that set ``shutdown_seconds``, for messages (Horovod's name when the user set that); ``where``:
        which process set the messages are about (`` in the process set of ranks [1, 2]``; empty: the job's)."""
        self.rank = rank
        self.where = where
        self.shutdown_variable = shutdown_variable
        self.job_rank = rank if job_rank is None else job_rank
        self.check_seconds = check_seconds
        self.shutdown_seconds = shutdown_seconds
        limits = [s for s in (check_seconds, shutdown_seconds) if s > 0]
        self.limit = min(limits) if limits else 0.0
        self._next_probe = time.monotonic() + 1.0
        self._last_check = time.monotonic()

    def due(self, waiting: Callable[[], list]) -> bool:
        """Whether this rank asks for a check now: its oldest waiting request is past the limit
        (looked at no more than twice per limit, at most every second)."""
        limit = self.limit
        if not limit:
            return False
        now = time.monotonic()
        if now < self._next_probe:
            return False
        self._next_probe = now + min(1.0, limit / 2)
        if now - self._last_check < limit:
            return False
        reqs = waiting()
        if not reqs:
            return False
        oldest = min(r.t_submit for r in reqs)
        return time.perf_counter() - oldest >= limit

    def check(self, report) -> Optional[AiaccError]:
        """Act on the collective ``report`` (``Negotiator.stall_report``): warn, or return the error
        that ends every rank."""
        self._last_check = time.monotonic()
        stalled = [item for item in report if item.age >= self.limit]
        if not stalled:
            return None
        crossed = _crossed_setups(stalled)
        if crossed is not None:
            if self.rank == 0:
                logger.error("%s", crossed)
            return crossed
        stop_after = self.shutdown_seconds
        fatal = stop_after > 0 and any(item.age >= stop_after for item in stalled)
        if fatal:
            # The job ends here: name every tensor some rank is still waiting for, also those
            # submitted after the oldest one (a rank that waits on a younger tensor is as stuck).
            stalled = report
        lines = [f"tensor {name!r}: submitted {age:.1f} s ago by ranks {have}, "
                 f"still missing on ranks {missing}" for name, have, missing, age in stalled[:20]]
        if len(stalled) > 20:
            lines.append(f"... and {len(stalled) - 20} more tensors")
        text = "\n  ".join(lines)
        if fatal:
            error = StallError(
                f"aiacc stopped after a stall of more than {stop_after:g} s "
                f"({self.shutdown_variable}){self.where}; some ranks never submitted these tensors:\n  {text}")
            if self.rank == 0:
                logger.error("%s", error)
            return error
        if self.rank == 0:
            logger.warning("aiacc stall: some ranks have not submitted tensors the others are waiting for%s "
                           "(one rank may be behind, or ranks run different code paths):\n  %s", self.where, text)
        return None

    def engines_silent(self, waited: float) -> bool:
        """This engine has waited ``waited`` s for the other ranks' engines in a collective: warn;
        True when that is past the shutdown limit (the caller aborts the job)."""
        limit = self.shutdown_seconds
        logger.warning("aiacc rank %d: the engine has waited %.0f s for the other ranks' engines; a rank may be "
                       "stuck outside aiacc (for example holding the GIL in a long call)", self.job_rank, waited)
        if limit > 0 and waited >= limit:
            logger.error("aiacc rank %d: no answer from the other ranks for %.0f s (%s=%g); aborting the job",
                         self.job_rank, waited, self.shutdown_variable, limit)
            return True
        return False


def _crossed_setups(stalled) -> Optional[TensorMismatchError]:
    """Two sets of gradient buckets whose first steps wait for each other: some ranks agree on one, other
    ranks on another, neither on both. The ranks hand different lists of gradients to their distributed
    optimizers (in number, or in name); nothing they do later meets, so the job ends now."""
    setups = [item for item in stalled if item.name.startswith(BUCKET_SETUP_PREFIX)]
    for a in setups:
        for b in setups:
            if set(a.have) & set(b.missing) and set(b.have) & set(a.missing):
                # every set some rank waits in (at 3 ranks there can be three; only the first crossed pair was
                # named, and with it not every rank)
                sets = {}
                for item in setups:
                    ranks = sets.setdefault(item.name.rsplit(".", 1)[0], set())  # (without its collective's suffix)
                    ranks.update(item.have)
                where = ", ".join(f"ranks {sorted(ranks)} in {key!r}"
                                  for key, ranks in sorted(sets.items(), key=lambda kv: (min(kv[1]), kv[0])))
                return TensorMismatchError(
                    f"the ranks set up gradient buckets for different lists of gradients and wait for each other "
                    f"(for {a.age:.0f} s): {where} (after "
                    f"'{BUCKET_SETUP_PREFIX}': the set's number on its engine, or the name of the TensorFlow "
                    "DistributedGradientTape / DistributedOptimizer). "
                    "Every rank must hand the same parameters, in the same order, to DistributedOptimizer / "
                    "DistributedGradientTape / DistributedTrainer, and make as many of them, in the same order")
    return None
