"""Code that ``torch.compile`` must never trace: aiacc's Python that talks to the engine.

Dynamo takes every Python frame run inside a compiled region for user code and traces it. Two kinds of
aiacc frames get there: the c10d backend's methods, which torch's C++ calls also while a compiled frame
runs (DDP's bucket rebuild under ``torch.compile(DDP(model))``, a ``dist.broadcast`` inside a compiled
function): dynamo failed on the process group object ("UnsafeScriptObjectError ... Member '_name' is not
registered"), where gloo's C++ has no frame to trace; and ``DistributedOptimizer.step`` under torch's
compiled-optimizer recipe (``torch.compile(opt.step)``, or a compiled function that calls ``opt.step()``),
where dynamo stopped with an internal ``SpeculationLogDivergence`` while tracing the wait for the engine.
Such frames run as they are, as ``torch.compiler.disable`` makes them (with a graph break around them):
through dynamo's C-level skip of a code object (its frames and the frames they call), which needs no
import of dynamo (0.7 s).
"""

from __future__ import annotations


def not_traced(*classes) -> None:
    """torch.compile never traces the methods of ``classes`` (nor what they call)."""
    try:
        from torch._C._dynamo.eval_frame import (  # noqa: PLC0415
            _FrameAction, _FrameExecStrategy, set_code_exec_strategy)
    except ImportError:  # (a torch without these: nothing to do, or nothing possible)
        return
    skip = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
    for cls in classes:
        for fn in vars(cls).values():
            code = getattr(fn, "__code__", None)
            if code is not None:
                set_code_exec_strategy(code, skip)
