"""torchtop: a terminal monitor for PyTorch training.

In a training script::

    import torchtop
    torchtop.start()              # the agent: attach with `torchtop attach`
    with torchtop.phase("eval"):  # a labelled span on the timeline
        ...

Importing this package is cheap and never imports torch; ``start()`` does.
"""

from __future__ import annotations

from typing import Any

from torchtop.agent.phases import mark, phase
from torchtop.agent.steps import step

__version__ = "0.1.0"


def start(**options: Any) -> None:
    """Start the in-process agent (idempotent); options are ``AgentConfig`` fields."""
    from torchtop.agent.rank_start import start as _start

    _start(**options)


def stop() -> None:
    """Stop the agent and remove its socket. The job goes on."""
    from torchtop.agent.core import stop as _stop

    _stop()


__all__ = ["__version__", "mark", "phase", "start", "step", "stop"]
