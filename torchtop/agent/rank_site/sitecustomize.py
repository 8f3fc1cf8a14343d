"""Starts the torchtop agent in each process of a job that becomes a rank, with no change to
the training script, whatever started it: torchrun, ``torch.multiprocessing.spawn``,
Lightning's launcher, SLURM or MPI.

``torchtop run`` puts this folder first on ``PYTHONPATH``, so every Python process of the job
imports this module at startup. It first runs the ``sitecustomize`` that would otherwise have
run (later on the path), as ``opentelemetry-instrument`` and ``ddtrace-run`` do. Then:

- where the launcher's environment already names this process's rank (:func:`launcher_rank`:
  torchrun's marks, SLURM's and Open MPI's task marks, Lightning's ``LOCAL_RANK`` +
  ``WORLD_SIZE``), the agent starts at once (:func:`should_start`);
- everywhere, a :class:`GroupWatcher` waits for ``torch.distributed`` to load and wraps its
  ``init_process_group``: once a process group exists in this process, it is a rank, and gets
  an agent (or, having one, its rank identity) from :mod:`torchtop.agent.rank_start`.

Where ``torchtop run`` chose how the job writes its output, each process writes whole lines
(:func:`whole_lines`): a rank's line copied on by torchrun, or written into a pipe that other
processes share, is never cut in two.

A process that starts an agent marks the environment with the rank it has
(:data:`OWNER_RANK_ENV`), so the processes it starts (DataLoader workers under spawn or
forkserver, any subprocess) inherit the mark and start none from the same marks; forked workers
never run ``sitecustomize`` at all, and a worker never joins a process group.

This module and the one it reads the marks with (``torchtop_rank_marks``, beside it) are
standard library only and import nothing of torchtop until a process is a rank: every Python
process of every job runs them. Nothing here may fail the process: errors are reported in one
line and the job goes on.
"""

from __future__ import annotations

import os
import sys

from torchtop_rank_marks import (  # this folder is first on the job's path
    RANK_OPTIONS_ENV,
    GroupWatcher,
    should_start,
    whole_lines,
    wrap_init_process_group,
)


def _joined() -> None:
    """A process group now exists here: this process is a rank."""
    try:
        from torchtop.agent.rank_start import joined_group

        joined_group()
    except Exception as exc:  # the job runs on without its agent
        print(f"torchtop: no agent in this rank: {exc!r}", file=sys.stderr)


def _chain() -> None:
    """Run the next ``sitecustomize`` on ``sys.path`` (the one this module displaced)."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def _start() -> None:
    whole_lines(os.environ, (sys.stdout, sys.stderr))
    if RANK_OPTIONS_ENV not in os.environ:
        return
    if should_start(os.environ):
        from torchtop.agent.rank_start import start_if_rank

        start_if_rank()
    if not wrap_init_process_group(_joined):
        sys.meta_path.insert(0, GroupWatcher(_joined))


if __name__ == "sitecustomize":  # at startup; imported by its package name, only read
    try:
        _chain()
    finally:
        try:
            _start()
        except Exception as exc:  # the job runs on without its agent
            print(f"torchtop: no agent in this rank: {exc!r}", file=sys.stderr)
