"""Which rank of which run this process is, from the environment a launcher set.

torchrun (and most launchers built on torch.distributed) export ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``GROUP_RANK``, ``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_RESTART_COUNT`` to each
rank; a job started by hand can set the same. A value that is absent or unreadable is ``None``,
never a guess, so a single process has no rank at all.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

#: torchrun's run id when no rendezvous id was given: says nothing about the run.
_NO_RUN_ID = "none"


def _int(environ: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        text = environ.get(name, "").strip()
        if text:
            try:
                value = int(text)
            except ValueError:
                return None
            return value if value >= 0 else None
    return None


def rank_identity(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``Hello`` identity fields of this process (``rank``, ``local_rank``, ...)."""
    env = os.environ if environ is None else environ
    run_id = env.get("TORCHELASTIC_RUN_ID", "").strip()
    return {
        "rank": _int(env, "RANK"),
        "local_rank": _int(env, "LOCAL_RANK"),
        "world_size": _int(env, "WORLD_SIZE"),
        "node_rank": _int(env, "GROUP_RANK", "NODE_RANK"),
        "run_id": run_id if run_id and run_id != _NO_RUN_ID else None,
        "restart_count": _int(env, "TORCHELASTIC_RESTART_COUNT"),
    }
