"""Events raised in the training thread: phases and marks.

The training thread only appends a tuple to a deque (atomic in CPython, well under a
microsecond); the sampler thread drains it, encodes and publishes. With no agent running the
calls still work and cost the same, so scripts and demos can use them unconditionally.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

#: Events not yet seen by the sampler: (kind, t, name, id). Bounded so that a script using
#: phases without an agent cannot grow memory; the oldest events drop first.
PENDING: deque[tuple[str, float, str, int]] = deque(maxlen=65536)
_ids = itertools.count(1)


@contextmanager
def phase(name: str) -> Iterator[None]:
    """A labelled span on the timeline, e.g. ``with torchtop.phase("eval"): ...``.

    The report gives each phase its duration and peak memory.
    """
    phase_id = next(_ids)
    PENDING.append(("phase_began", time.time(), str(name), phase_id))
    try:
        yield
    finally:
        PENDING.append(("phase_ended", time.time(), str(name), phase_id))


def mark(name: str) -> None:
    """A labelled instant on the timeline."""
    PENDING.append(("mark", time.time(), str(name), 0))
