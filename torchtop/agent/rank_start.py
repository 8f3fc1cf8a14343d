"""Which processes of a torchrun job get an agent, for ``torchtop run torchrun ...``.

``torchtop run`` starts a launcher (``torchrun``, ``python -m torch.distributed.run``) with
``TORCHTOP_RANK_OPTIONS`` set and :data:`SITE_DIR` first on ``PYTHONPATH``; its
``sitecustomize`` calls :func:`start_if_rank` in every new Python process. A process is a rank
when torchelastic gave it ``RANK``, ``LOCAL_RANK`` and ``TORCHELASTIC_RUN_ID``: the launcher's
own elastic agent has none of them. A rank that has started its agent marks the environment
(:data:`OWNER_ENV`, its pid), so the processes it starts (DataLoader workers under spawn or
forkserver, any subprocess) inherit the mark and start none; forked workers never run
``sitecustomize`` at all. A rank whose script calls ``torchtop.start()`` itself gets the agent
already running (``start`` is once per process).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from torchtop.job_output import RANK_PREFIX_TEMPLATE

#: The agent's options (JSON) for each rank; its presence turns rank start-up on.
RANK_OPTIONS_ENV = "TORCHTOP_RANK_OPTIONS"
#: Set by a rank once its agent runs: the pid of that rank.
OWNER_ENV = "TORCHTOP_RANK_AGENT_PID"
#: torchelastic sets these in each rank it starts, and not in its own process.
RANK_MARKS = ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")
#: The folder ``torchtop run`` puts first on ``PYTHONPATH`` (holds ``sitecustomize.py``).
SITE_DIR = Path(__file__).with_name("rank_site")
#: torchrun's options (and their environment variables) that say where the ranks' output goes.
OUTPUT_OPTIONS = ("--tee", "-t", "--redirects", "-r")
OUTPUT_ENV = ("PET_TEE", "PET_REDIRECTS")


def should_start(env: Mapping[str, str]) -> bool:
    """True in a rank that torchelastic started under ``torchtop run``, and nowhere else."""
    if RANK_OPTIONS_ENV not in env or env.get(OWNER_ENV):
        return False
    return all(env.get(name) for name in RANK_MARKS)


def start_if_rank() -> bool:
    """Start the agent here if this process is a rank (see :func:`should_start`)."""
    if not should_start(os.environ):
        return False
    options = json.loads(os.environ.get(RANK_OPTIONS_ENV) or "{}")
    os.environ[OWNER_ENV] = str(os.getpid())
    from torchtop.agent import core

    core.start(**options)
    return True


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
    env: Mapping[str, str], options: Mapping[str, object], args: Sequence[str] = ()
) -> dict[str, str]:
    """``env`` for a launcher (run with ``args``) whose ranks each start an agent with
    ``options``, and whose output shows each rank's lines with its rank's prefix.

    The prefix is torchrun's own ``--tee``: each rank writes into a file in torchrun's log
    folder and the launcher copies each line on with ``[rank<N>]:`` in front (the rank's
    lines outlive a rank that is killed; the launcher's own lines have no prefix). Where the
    user chose ``--tee`` or ``--redirects`` themselves, their choice stands.
    """
    out = {k: v for k, v in env.items() if k != OWNER_ENV}
    out[RANK_OPTIONS_ENV] = json.dumps(dict(options))
    previous = out.get("PYTHONPATH")
    out["PYTHONPATH"] = str(SITE_DIR) + (os.pathsep + previous if previous else "")
    if not chooses_output(args) and not any(name in out for name in OUTPUT_ENV):
        out["PET_TEE"] = "3"
    out.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", RANK_PREFIX_TEMPLATE)
    return out
