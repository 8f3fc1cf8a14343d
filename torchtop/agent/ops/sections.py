"""Sections of the job's code around which op windows open or never open, whatever the
schedule: :func:`window` and :func:`paused`, for the agent's sampler in this process."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol


class Windows(Protocol):
    """What these sections need of the agent's op sampler
    (:class:`~torchtop.agent.ops.sampler.OpsSampler`, which registers itself here)."""

    def window(self) -> contextlib.AbstractContextManager[bool]: ...

    def close_now(self, *, disarm: bool = True) -> None: ...


#: Nesting depth of :func:`paused` sections: no window opens while above zero.
_paused = [0]
#: The agent's sampler, for :func:`paused` to close a window that is open.
_active: list[Windows | None] = [None]


def window() -> contextlib.AbstractContextManager[bool]:
    """A window around a section, now, if an agent samples op timings in this process (yields
    whether one opened): see :meth:`OpsSampler.window`."""
    sampler = _active[0]
    if sampler is None:
        return contextlib.nullcontext(False)
    return sampler.window()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No op window in this section: one open in this thread closes first, and none opens
    until the section ends. For code that times itself (the demos' timing passes), which a
    profiled step would slow down several times."""
    _paused[0] += 1
    sampler = _active[0]
    if sampler is not None:
        sampler.close_now(disarm=False)
    try:
        yield
    finally:
        _paused[0] -= 1
