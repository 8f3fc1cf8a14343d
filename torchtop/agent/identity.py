"""Which rank of which run this process is, from the environment a launcher set.

torchrun (and most launchers built on torch.distributed) export ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``GROUP_RANK``, ``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_RESTART_COUNT`` to each
rank; a job started by hand can set the same. Without ``RANK``, a scheduler's task marks name the
rank: SLURM's ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS``, Open MPI's
``OMPI_COMM_WORLD_*``, and Lightning's ``LOCAL_RANK`` + ``WORLD_SIZE`` (+ ``NODE_RANK``) in the
processes its launcher re-runs. A value that is absent or unreadable is ``None``, never a guess,
so a single process (or a single task) has no rank at all.

The run's id: torchrun's, else the scheduler's job step, else the one ``torchtop run`` passed
down (``TORCHTOP_RUN_ID``), so the ranks of one run share it whatever started them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

#: torchrun's run id when no rendezvous id was given: says nothing about the run.
_NO_RUN_ID = "none"
#: The run id ``torchtop run`` gives each job, for launchers that give none.
RUN_ID_ENV = "TORCHTOP_RUN_ID"
#: Each scheduler's task marks: rank, local rank, world size, node rank.
SCHEDULER_MARKS = (
    ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODEID"),
    (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_NODE_RANK",
    ),
)


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


def _run_id(env: Mapping[str, str], ranked: bool) -> str | None:
    run_id = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if run_id and run_id != _NO_RUN_ID:
        return run_id
    if not ranked:
        return None
    job = env.get("SLURM_JOB_ID", "").strip()
    if job and "SLURM_PROCID" in env:
        step = env.get("SLURM_STEP_ID", "").strip()
        return f"slurm-{job}.{step}" if step else f"slurm-{job}"
    return env.get(RUN_ID_ENV, "").strip() or None


def rank_identity(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``Hello`` identity fields of this process (``rank``, ``local_rank``, ...)."""
    env = os.environ if environ is None else environ
    rank = _int(env, "RANK")
    local_rank = _int(env, "LOCAL_RANK")
    world_size = _int(env, "WORLD_SIZE")
    node_rank = _int(env, "GROUP_RANK", "NODE_RANK")
    if not env.get("RANK", "").strip():
        for rank_name, local_name, size_name, node_name in SCHEDULER_MARKS:
            size = _int(env, size_name)
            if env.get(rank_name, "").strip() and size is not None and size > 1:
                rank, world_size = _int(env, rank_name), size
                local_rank, node_rank = _int(env, local_name), _int(env, node_name)
                break
        else:
            if local_rank is not None and world_size is not None and world_size > 1:
                # Lightning's launcher: on the first node the global rank is the local one.
                rank = local_rank if node_rank in (None, 0) else None
    return {
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world_size,
        "node_rank": node_rank,
        "run_id": _run_id(env, rank is not None),
        "restart_count": _int(env, "TORCHELASTIC_RESTART_COUNT"),
    }


def group_identity(
    rank: int,
    world_size: int,
    environ: Mapping[str, str] | None = None,
    group_id: str | None = None,
) -> dict[str, Any]:
    """The identity of a process that is rank ``rank`` of a process group of ``world_size``:
    its local and node rank from the launcher's marks where they name the same rank; its run
    the launcher's or torchtop's, else ``group_id`` (the same in every rank of the group)."""
    env = os.environ if environ is None else environ
    marks = rank_identity(env)
    same = marks["rank"] == rank
    return {
        **marks,
        "rank": rank,
        "world_size": world_size,
        "local_rank": marks["local_rank"] if same else None,
        "node_rank": marks["node_rank"] if same else None,
        "run_id": marks["run_id"] or _run_id(env, True) or group_id,
    }
