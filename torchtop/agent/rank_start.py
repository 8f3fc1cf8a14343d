"""Which processes of a job get an agent: every process that becomes a rank.

``torchtop run`` starts every job with ``TORCHTOP_RANK_OPTIONS`` and ``TORCHTOP_RUN_ID`` set and
:data:`SITE_DIR` first on ``PYTHONPATH``; its ``sitecustomize`` (standard library only, see
there for the rules) calls :func:`start_if_rank` in a process whose launcher named its rank, and
:func:`joined_group` in one that has just initialised a ``torch.distributed`` process group.
A rank whose script calls ``torchtop.start()`` itself gets the agent already running (``start``
is once per process); a process that already had an agent (the job's own process, when it
becomes rank 0 as Lightning's does) keeps it and announces its rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchtop.agent.identity import RUN_ID_ENV, group_identity
from torchtop.agent.rank_site.torchtop_rank_marks import (
    OWNER_ENV,
    OWNER_RANK_ENV,
    RANK_MARKS,
    RANK_OPTIONS_ENV,
    WHOLE_LINES_ENV,
    GroupWatcher,
    enable_recorder,
    launcher_rank,
    should_start,
    unbuffered,
    wrap_init_process_group,
)
from torchtop.job_output import RANK_PREFIX_TEMPLATE

if TYPE_CHECKING:
    from torchtop.agent.core import Agent

__all__ = [
    "OWNER_ENV",
    "OWNER_RANK_ENV",
    "RANK_MARKS",
    "RANK_OPTIONS_ENV",
    "RUN_ID_ENV",
    "SITE_DIR",
    "job_environment",
    "joined_group",
    "new_run_id",
    "rank_environment",
    "should_start",
    "start_if_rank",
    "unbuffered",
]

#: Whether this process already waits for its process group (:func:`follow_group`).
_following = False
#: The folder ``torchtop run`` puts first on ``PYTHONPATH`` (holds ``sitecustomize.py``).
SITE_DIR = Path(__file__).with_name("rank_site")
#: torchrun's options (and their environment variables) that say where the ranks' output goes.
OUTPUT_OPTIONS = ("--tee", "-t", "--redirects", "-r")
OUTPUT_ENV = ("PET_TEE", "PET_REDIRECTS")


def _mark_owner() -> None:
    """This process has the agent of the rank its environment names (if any): the processes
    it starts inherit the mark and start none from the same marks."""
    os.environ[OWNER_ENV] = str(os.getpid())
    rank = launcher_rank(os.environ)
    if rank is None:
        os.environ.pop(OWNER_RANK_ENV, None)
    else:
        os.environ[OWNER_RANK_ENV] = rank


def _options() -> dict[str, Any]:
    return dict(json.loads(os.environ.get(RANK_OPTIONS_ENV) or "{}"))


def start_if_rank() -> bool:
    """Start the agent here if the launcher named this process's rank (see
    :func:`~torchtop.agent.rank_site.torchtop_rank_marks.should_start`)."""
    if not should_start(os.environ):
        return False
    _mark_owner()
    from torchtop.agent import core

    core.start(**_options())
    return True


def joined_group() -> None:
    """A ``torch.distributed`` process group was just initialised in this process: it is a
    rank. Its agent (started now, or the one it had) says which, from the group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    rank, world_size = dist.get_rank(), dist.get_world_size()
    from torchtop.agent import core

    agent = core.current()
    running = agent is not None and agent.pid == os.getpid() and not agent.finished
    if world_size < 2 and running:
        return  # a group of one beside no other rank: the job stays a single process
    identity = group_identity(rank, world_size, group_id=_store_id(dist))
    _mark_owner()
    if running:
        assert agent is not None
        agent.announce_identity(identity)
    elif RANK_OPTIONS_ENV in os.environ:
        core.start(identity=identity, **_options())


def _store_id(dist: Any) -> str | None:
    """The address of the process group's store, the same in all its ranks: a run's id where
    no launcher and no ``torchtop run`` gave one (``torchtop.start()`` in mp.spawn's ranks)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        return f"pg-{store.host}:{store.port}"
    except Exception:  # not a TCP store (a file, a hash store): no id
        return None


def start(identity: dict[str, Any] | None = None, **options: Any) -> Agent:
    """Start the agent in this process (:func:`torchtop.agent.core.start`, once); one that no
    launcher named a rank learns it from its process group, now or when the job makes one."""
    from torchtop.agent import core

    agent = core.start(identity, **options)
    if agent.identity.get("rank") is None:
        with contextlib.suppress(Exception):
            follow_group()
    return agent


def follow_group() -> None:
    """For an agent started in the script (``torchtop.start()``) that no launcher named a
    rank: its rank once its process group exists (now, or when it is initialised). Once per
    process."""
    global _following
    if _following:
        return
    _following = True
    if wrap_init_process_group(_announce):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            joined_group()
    else:
        sys.meta_path.insert(0, GroupWatcher(_announce))


def _announce() -> None:
    try:
        joined_group()
    except Exception as exc:  # the job runs on; its agent stays a single process's
        print(f"torchtop: this rank's agent does not know its rank: {exc!r}", file=sys.stderr)


def new_run_id() -> str:
    """One run's id, for the ranks of a launcher that gives none."""
    return f"tt-{uuid.uuid4().hex[:12]}"


def job_environment(
    env: Mapping[str, str], options: Mapping[str, object], run_id: str | None = None
) -> dict[str, str]:
    """``env`` for a job whose ranks (any process that becomes one) each start an agent with
    ``options``, sharing ``run_id``. The job's own process is no new rank: the launcher's
    marks it has are marked as its own."""
    out = {k: v for k, v in env.items() if k not in (OWNER_ENV, OWNER_RANK_ENV)}
    out[RANK_OPTIONS_ENV] = json.dumps(dict(options))
    out[RUN_ID_ENV] = run_id or new_run_id()
    enable_recorder(out)  # before any process group exists; a size the user set is kept
    previous = out.get("PYTHONPATH")
    out["PYTHONPATH"] = str(SITE_DIR) + (os.pathsep + previous if previous else "")
    rank = launcher_rank(out)
    if rank is not None:
        out[OWNER_RANK_ENV] = rank
    return out


def chooses_output(args: Sequence[str]) -> bool:
    """The launcher's arguments (up to the script) say where the ranks' output goes."""
    for arg in args:
        if arg.endswith(".py"):
            break
        name = arg.split("=", 1)[0]
        if name in OUTPUT_OPTIONS or (name[:2] in ("-t", "-r") and not name.startswith("--")):
            return True
    return False


def rank_environment(
    env: Mapping[str, str],
    options: Mapping[str, object],
    args: Sequence[str] = (),
    run_id: str | None = None,
) -> dict[str, str]:
    """``env`` for a launcher (run with ``args``) whose ranks each start an agent with
    ``options``, and whose output shows each rank's lines with its rank's prefix.

    The prefix is torchrun's own ``--tee``: each rank writes into a file in torchrun's log
    folder and the launcher copies each line on with ``[rank<N>]:`` in front (the rank's
    lines outlive a rank that is killed; the launcher's own lines have no prefix). Where the
    user chose ``--tee`` or ``--redirects`` themselves, their choice stands.
    """
    out = job_environment(env, options, run_id)
    if not chooses_output(args) and not any(name in out for name in OUTPUT_ENV):
        out["PET_TEE"] = "3"
        out[WHOLE_LINES_ENV] = "1"  # torchrun copies each rank's file on a line at a time
    out.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", RANK_PREFIX_TEMPLATE)
    return out
