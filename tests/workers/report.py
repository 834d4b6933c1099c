"""One atomic write per line, so lines of different ranks never interleave in the job's output."""

import os
import sys


def say(text: str) -> None:
    os.write(1, (text.rstrip("\n") + "\n").encode())


def raises(exc_types, fn, *words: str) -> str:
    """Call ``fn``; it must raise one of ``exc_types`` whose message holds every one of ``words``.
    Returns the message."""
    try:
        fn()
    except exc_types as exc:
        text = str(exc)
        for w in words:
            assert w in text, f"{type(exc).__name__} message lacks {w!r}: {text}"
        return text
    raise AssertionError(f"expected {exc_types!r} with {words!r}; nothing was raised")


def hold_back_commit_copies(torch_elastic, event, seconds: float = 2.0) -> None:
    """An elastic commit's background copy of optimizer state (``torch_elastic.idle_priority`` starts it) waits
    until ``event`` is set or ``seconds`` pass: the step that races it runs first, every time."""
    real = torch_elastic.idle_priority

    def held_back():
        event.wait(seconds)
        real()

    torch_elastic.idle_priority = held_back


def assert_matches(what: str, got, want, dtype, tolerances: dict) -> None:
    """``got`` (a numpy array) has ``dtype``, ``want``'s shape and its values: within
    ``tolerances[dtype]`` (relative and absolute) for the dtypes listed there, exactly for the others."""
    import numpy as np  # noqa: PLC0415 - only the workers that compare arrays need it

    assert got.dtype == np.dtype(dtype), f"{what}: dtype {got.dtype} != {dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    tol = tolerances.get(dtype, 0)
    if tol:
        assert np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol), \
            f"{what}: max err {np.abs(got.astype(np.float64) - want).max()}"
    else:
        assert np.array_equal(got, want.astype(dtype)), f"{what}: {got.ravel()[:6]} != {want.ravel()[:6]}"


def check_replay(clock, profile, dilate: float, steps: int, lr: float, ranks: int, arrays) -> int:
    """A replay model trained ``steps`` plain-SGD steps from zero with x = rank + 1 on every rank: its layers
    asked for their dilated times (every forward and backward once per step), and every parameter of layer
    i (``arrays``: (name, numpy array) in the profile's order) is -lr * steps * coeff_i * mean(rank + 1).
    Returns the number of checks made."""
    from aiacc.bench.replay import layer_coefficient  # noqa: PLC0415 - only the replay workers need it

    assert clock.sleeps == steps * 2 * len(profile.layers), clock.sleeps
    want = steps * dilate * profile.compute_ms * 1e-3
    assert abs(clock.requested_s - want) < 1e-9 * max(1.0, want), (clock.requested_s, want)
    checks = 1
    mean_input = sum(range(1, ranks + 1)) / ranks
    index = [i for i, lay in enumerate(profile.layers) for _ in lay.params]
    for i, (name, got) in zip(index, arrays):
        expect = -lr * steps * layer_coefficient(i) * mean_input
        assert expect != 0 and (got == expect).all(), (name, got.flat[:3], expect)
        checks += 1
    return checks


def kill_on_first_start(hit: bool) -> None:
    """SIGKILL this rank when ``hit`` and the job is on its first start (never after a restart): the fault
    the elastic workers inject."""
    import signal  # noqa: PLC0415

    from aiacc.elastic import restart_count  # noqa: PLC0415

    if hit and restart_count() == 0:
        os.kill(os.getpid(), signal.SIGKILL)


def report_same_start(rank: int, seen, counts) -> None:
    """The same-start workers' output, in one write: a ``WARNED`` line per same-start warning caught (``seen``), the
    collectives per step (``counts``: running totals), then ``OK``."""
    out = [f"WARNED rank={rank} {w.category.__name__} {w.filename.rsplit('/', 1)[-1]}: {w.message}\n" for w in seen
           if "do not train the same model" in str(w.message)]
    out.append(f"COUNTS rank={rank} {[b - a for a, b in zip(counts, counts[1:])]}\nOK rank={rank}\n")
    sys.stdout.write("".join(out))
    sys.stdout.flush()
