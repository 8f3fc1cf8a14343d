"""Starts the torchtop agent early in each rank of a job that ``torchtop run`` launched through
torchrun (or ``python -m torch.distributed.run``), with no change to the training script.

``torchtop run`` puts this folder first on ``PYTHONPATH``, so every Python process of the job
imports this module at startup. It first runs the ``sitecustomize`` that would otherwise have
run (later on the path), as ``opentelemetry-instrument`` and ``ddtrace-run`` do, then starts the
agent only where :func:`torchtop.agent.rank_start.should_start` says this process is a rank: the
launcher's elastic agent, DataLoader workers and any other process a rank starts get none.
Nothing here may fail the process: errors are reported in one line and the job goes on.
"""

import os
import sys


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
    if "TORCHTOP_RANK_OPTIONS" not in os.environ:
        return
    from torchtop.agent.rank_start import start_if_rank

    start_if_rank()


try:
    _chain()
finally:
    try:
        _start()
    except Exception as exc:  # the job runs on without its agent
        print(f"torchtop: no agent in this rank: {exc!r}", file=sys.stderr)
