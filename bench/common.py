"""What every benchmark shares: output format and the model definitions.

Output: a human-readable table by default; with ``--json`` one JSON object
per line (each a dict with at least ``bench`` and the figures).

Models: every framework's ``train`` benchmark builds the same two models from
these numbers, so samples/s compare across frameworks:

* ``cnn``: input 3x32x32; conv3x3(3->32)+relu, conv3x3(32->64)+relu, maxpool2,
  conv3x3(64->128)+relu, maxpool2, flatten, dense(128*8*8->256)+relu, dense(256->10).
  About 2.2 M parameters, most of them in the first dense layer.
* ``transformer``: sequence 64 tokens, vocabulary 1000, embedding 128, 2 encoder
  layers (4 heads, feed-forward 512, post-norm), mean-pool, dense(128->10).
  About 0.53 M parameters in ~30 tensors: many small gradients.
* ``narrow``: the same transformer, narrow and deep: sequence 32, embedding 64,
  13 encoder layers (4 heads, feed-forward 128). 0.50 M parameters in 159
  tensors, as many as a real network has (ResNet-50: 161): the model where a
  cost per gradient shows.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import Dict, Iterable, List

MODELS: Dict[str, dict] = {
    "cnn": dict(image=(3, 32, 32), channels=(32, 64, 128), hidden=256, classes=10),
    "transformer": dict(seq=64, vocab=1000, d_model=128, heads=4, ff=512, layers=2, classes=10),
    "narrow": dict(seq=32, vocab=1000, d_model=64, heads=4, ff=128, layers=13, classes=10),
}


# ---- argument types: a bad value is the parser's error naming the flag ("argument --steps: ...") ---------------
def _number(text: str, kind, low, low_ok: bool, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")) or value < low or (value == low and not low_ok):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, 1, True, "a whole number >= 1")


def nonneg_int(text: str) -> int:
    return _number(text, int, 0, True, "a whole number >= 0")


def positive_float(text: str) -> float:
    return _number(text, float, 0.0, False, "a finite number > 0")


def nonneg_float(text: str) -> float:
    return _number(text, float, 0.0, True, "a finite number >= 0")


def at_least(low: int):
    """A whole number >= ``low`` (an argparse type)."""
    def parse(text: str) -> int:
        return _number(text, int, low, True, f"a whole number >= {low}")
    return parse


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = _number(text, float, 0.0, False, "a number in (0, 1]")
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def positive_floats(text: str) -> List[float]:
    """A comma list of numbers > 0 (at least one)."""
    values = [positive_float(t) for t in text.split(",") if t.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected numbers > 0 separated by commas, got {text!r}")
    return values


def float32_bytes(text: str) -> int:
    """A message size such as ``4KiB`` or ``16MiB``: a whole number of float32 elements (a multiple of 4 bytes,
    at least 4), at most this machine's memory."""
    from aiacc.config import parse_bytes  # noqa: PLC0415

    try:
        value = parse_bytes(text)
    except (ValueError, OverflowError) as exc:
        raise argparse.ArgumentTypeError(f"expected a size such as 4KiB or 16MiB, got {text!r} ({exc})") from None
    if value < 4 or value % 4:
        raise argparse.ArgumentTypeError(f"expected a whole number of float32 elements (a multiple of 4 bytes, "
                                         f"at least 4), got {text!r} ({value} bytes)")
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if value > memory:
        raise argparse.ArgumentTypeError(f"{text!r} is more than this machine's memory ({memory / 2**30:.1f} GiB)")
    return value


def add_output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")


def free_port(host: str = "") -> int:
    """A TCP port free on ``host`` now (for a benchmark's own rendezvous: gloo, ps-lite)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def add_train_args(parser: argparse.ArgumentParser) -> None:
    """Arguments every framework's ``train`` benchmark accepts."""
    parser.add_argument("--framework", required=True, choices=["torch", "tensorflow", "mxnet", "jax"])
    parser.add_argument("--model", default="cnn", choices=sorted(MODELS))
    parser.add_argument("--batch-size", type=positive_int, default=32, help="per-rank batch size")
    parser.add_argument("--steps", type=positive_int, default=30, help="timed steps per measurement")
    parser.add_argument("--warmup", type=nonneg_int, default=5, help="untimed steps before each measurement")
    parser.add_argument("--repeats", type=positive_int, default=3, help="measurements per mode; the median is reported")
    add_output_args(parser)


def parse_impls(parser: argparse.ArgumentParser, given: str, known) -> List[str]:
    """``--impls`` (comma-separated) as a list, each one of ``known`` (else the parser's error)."""
    impls = [m.strip() for m in given.split(",") if m.strip()]
    if not impls:
        parser.error(f"--impls {given!r}: name at least one of {', '.join(known)}")
    for m in impls:
        if m not in known:
            parser.error(f"--impls: unknown implementation {m!r}; choose from {', '.join(known)}")
    return impls


# Every train bench's records carry these fields under these names (``impl`` is one of the stable
# implementation names of the framework's bench: aiacc, aiacc-tuned, ddp, ddp-tuned, tf-mwms, ...).
TRAIN_FIELDS = ["framework", "model", "impl", "ranks", "tensors", "samples/s", "step ms", "compute ms", "comm ms"]


def add_ratios(records: List[dict], baseline: str, column: str = None) -> None:
    """``vs BASELINE`` on every record: its samples/s over the baseline's, both the medians over the
    repeats -- the one way every ratio of the benchmarks is computed (a ratio of medians, so that
    any ratio can be checked from the samples/s columns beside it)."""
    base = [r["samples/s"] for r in records if r["impl"] == baseline]
    if base and base[0]:
        for r in records:
            if r["impl"] != "compute":
                r[column or f"vs {baseline}"] = r["samples/s"] / base[0]


def emit(records: Iterable[dict], as_json: bool, columns: List[str] = None, stream=None) -> None:
    """Print records as JSON lines or as an aligned table."""
    stream = stream or sys.stdout
    records = list(records)
    if as_json:
        for r in records:
            stream.write(json.dumps(r) + "\n")
        stream.flush()
        return
    if not records:
        return
    columns = columns or list(records[0])
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in records]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    stream.write("  ".join(c.rjust(w) for c, w in zip(columns, widths)) + "\n")
    for row in cells:
        stream.write("  ".join(v.rjust(w) for v, w in zip(row, widths)) + "\n")
    stream.flush()


def _fmt(v) -> str:
    if isinstance(v, float):
        if v == 0 or 1e-3 <= abs(v) < 1e6:
            return f"{v:.3f}"
        return f"{v:.3e}"
    return str(v)


def engine_cpu() -> float:
    """CPU seconds aiacc's engine thread has used so far (0 without an engine). The engine's own reading: the
    thread's CPU clock, or what it had used when it ended (reading the clock of an ended thread raised
    ProcessLookupError in a CI-like run)."""
    import aiacc  # noqa: PLC0415

    engine = aiacc.get_engine()
    return 0.0 if engine is None else engine._engine_cpu()


def cycle_cpu() -> float:
    """CPU seconds of every engine cycle so far, on whichever thread ran it (a thread waiting for a handle runs
    cycles itself, which the engine thread's clock leaves out)."""
    import aiacc  # noqa: PLC0415

    engine = aiacc.get_engine()
    return 0.0 if engine is None else engine.summary()["cycle_cpu_seconds"]


def median(values):
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
