"""What says that a process is a rank, and the hook that notices when it becomes one: the
launchers' marks in the environment (:func:`launcher_rank`, :func:`should_start`) and the wrap
of ``init_process_group`` (:func:`wrap_init_process_group`, :class:`GroupWatcher`), and the
flight recorder's ring that ``torchtop run`` turns on for every rank (:func:`enable_recorder`).

Shared by the job's ``sitecustomize`` (which imports it by this file's name: this folder is
first on the job's ``PYTHONPATH``) and by :mod:`torchtop.agent.rank_start`. Standard library
only, and it imports nothing of torchtop: every Python process of every job loads it.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # typing itself costs every process of every job a few milliseconds
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, MutableMapping
    from typing import Any

#: The agent's options (JSON) for each rank; its presence turns rank start-up on.
RANK_OPTIONS_ENV = "TORCHTOP_RANK_OPTIONS"
#: Set by a process once its agent runs: its pid, and the launcher's rank it had then.
OWNER_ENV = "TORCHTOP_RANK_AGENT_PID"
OWNER_RANK_ENV = "TORCHTOP_RANK_AGENT_RANK"
#: torchelastic sets these in each rank it starts, and not in its own process.
RANK_MARKS = ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")
#: A scheduler's task marks: the task's rank and the number of tasks.
TASK_MARKS = (
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS"),
    ("mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
)
#: Set where ``torchtop run`` itself decided how the job's Python writes its output (it made
#: it unbuffered, or chose torchrun's ``--tee``): each process then writes whole lines
#: (:func:`whole_lines`).
WHOLE_LINES_ENV = "TORCHTOP_WHOLE_LINES"
#: Where ``init_process_group`` lives, and the package that exports it.
C10D_MODULE = "torch.distributed.distributed_c10d"
DIST_MODULE = "torch.distributed"


def _above_one(text: str | None) -> bool:
    return text is not None and text.strip().isdigit() and int(text) > 1


def launcher_rank(env: Mapping[str, str]) -> str | None:
    """The rank a launcher's marks in ``env`` give this process (``"torchrun:1"``,
    ``"slurm:3"``, ``"local:0:1"``), or None where no launcher named one."""
    if all(env.get(name) for name in RANK_MARKS):
        return f"torchrun:{env['RANK']}"
    if env.get("RANK"):
        return None  # a rank set by hand: its process group says more, once it has one
    for kind, rank, size in TASK_MARKS:
        if env.get(rank) and _above_one(env.get(size)):
            return f"{kind}:{env[rank]}"
    if env.get("LOCAL_RANK") and _above_one(env.get("WORLD_SIZE")):
        node = env.get("NODE_RANK") or env.get("GROUP_RANK") or "0"
        return f"local:{node}:{env['LOCAL_RANK']}"
    return None


def should_start(env: Mapping[str, str]) -> bool:
    """True in a process under ``torchtop run`` whose launcher named its rank, unless the
    process that started it had that same rank (a DataLoader worker, a subprocess of a rank)."""
    if RANK_OPTIONS_ENV not in env:
        return False
    rank = launcher_rank(env)
    return rank is not None and env.get(OWNER_RANK_ENV) != rank


def _loaded(name: str) -> Any:
    """The module ``name`` if it has finished loading; never imports anything."""
    module = sys.modules.get(name)
    if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None
    return module


def _wrapped(original: Callable[..., Any], joined: Callable[[], None]) -> Callable[..., Any]:
    import functools

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        joined()
        return result

    init_process_group._torchtop = True  # type: ignore[attr-defined]
    return init_process_group


def wrap_init_process_group(joined: Callable[[], None]) -> bool:
    """Wrap ``init_process_group`` where the job can reach it (``torch.distributed`` and its
    ``distributed_c10d``); True once both are wrapped."""
    c10d = _loaded(C10D_MODULE)
    if c10d is None:
        return False
    original = getattr(c10d, "init_process_group", None)
    if original is None:
        return True  # a torch without it: nothing to wrap
    if getattr(original, "_torchtop", False):
        wrapper, original = original, original.__wrapped__
    else:
        wrapper = c10d.init_process_group = _wrapped(original, joined)
    dist = _loaded(DIST_MODULE)
    if dist is None:
        return False  # still loading: it may yet bind the original
    if getattr(dist, "init_process_group", None) is original:
        dist.init_process_group = wrapper
    return True


class GroupWatcher:
    """A ``sys.meta_path`` entry that finds nothing; it wraps ``init_process_group`` once
    ``torch.distributed`` has loaded (inside the job's ``import torch``), then leaves."""

    def __init__(self, joined: Callable[[], None]) -> None:
        self.active = True
        self._joined = joined

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if self.active and C10D_MODULE in sys.modules and wrap_init_process_group(self._joined):
            self.remove()
        return None

    def remove(self) -> None:
        """Leave ``sys.meta_path``; rebound, never changed in place, since another thread may
        be walking the list in an import at this moment."""
        self.active = False
        sys.meta_path = [finder for finder in sys.meta_path if finder is not self]


#: The flight recorder's ring length (read by torch when a process group is created).
BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
LEGACY_BUFFER_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"
#: The ring's length when the user set none (torch's own is 2000): each read of the ring dumps
#: all of it, so its cost grows with the length; 512 entries hold more than a second of most
#: jobs' collectives (what a read at the agent's pace needs) and several steps of history for
#: torch's own dump after a timeout.
DEFAULT_RING = 512


def enable_recorder(environ: MutableMapping[str, str]) -> bool:
    """Set a small ring unless the user set one; True when this call set it."""
    if BUFFER_ENV in environ or LEGACY_BUFFER_ENV in environ:
        return False
    environ[BUFFER_ENV] = str(DEFAULT_RING)
    return True


def unbuffered(environ: MutableMapping[str, str]) -> None:
    """Make the job's Python write each line as it ends, so that the viewer shows it at once:
    ``PYTHONUNBUFFERED`` where the user chose nothing (it holds even where no
    ``sitecustomize`` runs, under ``python -S``), marked for :func:`whole_lines`."""
    if "PYTHONUNBUFFERED" not in environ:
        environ["PYTHONUNBUFFERED"] = "1"
        environ[WHOLE_LINES_ENV] = "1"


def whole_lines(environ: Mapping[str, str], streams: tuple[Any, ...]) -> None:
    """Line-buffer ``streams`` (the process's stdout and stderr) where torchtop marked the
    job (:data:`WHOLE_LINES_ENV`).

    Unbuffered, ``print("rank", 1)`` writes its pieces one by one (the words, the spaces, the
    newline), and a reader between two pieces gets half a line: torchrun's ``--tee`` copies
    each rank's log file a line at a time and showed ``[rank1]:rank`` then ``[rank1]: 1``;
    processes writing into one pipe mix their pieces. Line-buffered, each line is written in
    one piece as soon as it ends, as a Python in a terminal writes it; text without a newline
    waits for one, or for the job's own ``flush()``.
    """
    if environ.get(WHOLE_LINES_ENV) != "1":
        return
    for stream in streams:
        try:
            stream.reconfigure(line_buffering=True, write_through=False)
        except Exception:  # a stream the job's own sitecustomize replaced: left as it is
            pass
