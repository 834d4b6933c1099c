"""One atomic write per line, so lines of different ranks never interleave in the job's output."""

import os


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
