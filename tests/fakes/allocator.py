"""torch's side of a failing CUDA allocation, for driving the agent's OOM observer without a GPU.

The caching allocator calls its OOM observers from C++ and then throws ``OutOfMemoryError``
into the Python frame that called the op; or torch catches it in C++ and retries with less
(cuDNN's workspace search). The agent tells these apart by where the error goes next, so a
test must call the observer the way torch does: from a frame of torch's (these functions are
compiled under a path inside torch's package), then raise into the job's code or retry.

The allocator calls every attached observer, in the order attached, from C++ and only then
raises: no Python line of the failing frame runs in between. ``allocate`` does the same (the
observers are called from ``map``, and the raise is on the same line), so a second observer, a
finalizer or an observer that allocates runs where it would on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from operator import methodcaller
from typing import Any

import torch

#: Where these functions' frames say they are: inside torch, so they count as torch's code.
ALLOCATOR_FILE = "/opt/venv/lib/python3.11/site-packages/torch/cuda/_allocator_in_tests.py"

_SOURCE = """
def allocate(observer, args, fails=True, traced=None):
    if fails:
        if traced is not None:
            traced(args[1])  # the allocator's oom entry in the trace
        observers = observer if isinstance(observer, list) else [observer]
        each = methodcaller("__call__", *args)
        list(map(each, observers)); raise torch.OutOfMemoryError("CUDA out of memory")
    return args[1]

def through_cleanups(observer, args):
    # torch's Python code around an op: a context manager and a finally, which run their
    # cleanup lines while the error unwinds through them.
    with contextlib.suppress(KeyError):
        try:
            return allocate(observer, args)
        finally:
            cleaned = True

def no_plan_fits(observer, args):
    # cuDNN's try_plans: each plan's workspace fails, then another error is raised.
    try:
        allocate(observer, args)
    except torch.OutOfMemoryError:
        pass
    raise RuntimeError("FIND was unable to find an engine to execute this computation")

def with_retries(observer, args, succeeds_at, traced):
    size = args[1]
    for attempt in range(64):
        try:
            return allocate(observer, (args[0], size, *args[2:]), attempt < succeeds_at, traced)
        except torch.OutOfMemoryError:
            if size <= 1 << 20:
                raise
            size //= 2
"""

_TORCH_SIDE: dict[str, Any] = {
    "torch": torch,
    "methodcaller": methodcaller,
    "contextlib": contextlib,
}
exec(compile(_SOURCE, ALLOCATOR_FILE, "exec"), _TORCH_SIDE)

allocate: Callable[..., int] = _TORCH_SIDE["allocate"]
with_retries: Callable[..., int] = _TORCH_SIDE["with_retries"]
through_cleanups: Callable[..., int] = _TORCH_SIDE["through_cleanups"]
no_plan_fits: Callable[..., int] = _TORCH_SIDE["no_plan_fits"]


def fail_into_job(
    observer: Callable[..., None] | list[Callable[..., None]], args: tuple[int, int, int, int]
) -> None:
    """A failed allocation whose error reaches the job's code (this frame), which catches it.
    ``observer`` is one observer or the list attached, in attach order."""
    try:
        allocate(observer, args)
    except torch.OutOfMemoryError:
        pass
