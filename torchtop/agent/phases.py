"""Phases and marks, raised in the training thread.

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

#: Events not yet seen by the sampler: (kind, t, name, id, description). Bounded so that a
#: script using phases without an agent cannot grow memory; the oldest events drop first.
PENDING: deque[tuple[str, float, str, int, str | None]] = deque(maxlen=65536)
#: The longest phase description sent; longer ones are cut with an ellipsis.
MAX_DESCRIPTION = 600
_ids = itertools.count(1)


@contextmanager
def phase(name: str, description: str | None = None) -> Iterator[None]:
    """A labelled span on the timeline, e.g. ``with torchtop.phase("eval"): ...``.

    The report gives each phase its duration and peak memory. ``description``, a few
    sentences on what the phase does, is shown beside the timeline while the phase runs.
    """
    phase_id = next(_ids)
    text = None
    if description is not None:
        text = " ".join(str(description).split())
        if len(text) > MAX_DESCRIPTION:
            text = text[: MAX_DESCRIPTION - 1] + "…"
    PENDING.append(("phase_began", time.time(), str(name), phase_id, text))
    try:
        yield
    finally:
        PENDING.append(("phase_ended", time.time(), str(name), phase_id, None))


def mark(name: str) -> None:
    """A labelled instant on the timeline."""
    PENDING.append(("mark", time.time(), str(name), 0, None))
