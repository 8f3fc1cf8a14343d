"""DataLoaders, seen from inside the job: how long the training thread waits for each batch.

Two class-level wrappers on ``torch.utils.data.dataloader._BaseDataLoaderIter``, so every
DataLoader iterator is covered whatever its subclass:

- ``__init__`` (once per iterator, that is per epoch unless workers persist) leaves an event
  with weak references to the iterator and its DataLoader, so the sampler thread can name the
  loader, read its settings and find its worker processes;
- ``__next__`` leaves the times before and after the original call and the batch's size.
  Whatever the original raises propagates as it was (StopIteration included); a StopIteration
  is timed too, since an epoch's last ``next()`` may join the workers.

:class:`LoaderTracker`, in the sampler thread, keeps one entry per DataLoader (``loader 0``,
``loader 1``… in the order the job first iterated them) and reads its workers with psutil.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torchtop.agent.steps import BATCH, EXHAUSTED, HOOK_S, ITERATOR, PENDING
from torchtop.protocol import LoaderInfo, LoaderStats, WorkerStats

_clock = time.perf_counter
_append = PENDING.append
#: Loaders kept at most; the oldest that no longer exist go first.
MAX_LOADERS = 32


def batch_size_of(batch: Any) -> int | None:
    """The leading dimension of the first tensor in a batch, looking two levels deep.

    Tensors (and arrays, by their ``shape``), lists and tuples (named ones too) and mappings:
    what collate functions return. The common cases cost a few type checks and one ``shape``
    read (``len(tensor)`` is a Python method in torch, several times slower).
    """
    for _ in range(3):
        cls = type(batch)
        if cls is tuple or cls is list:
            if not batch:
                return None
            batch = batch[0]
            continue
        if cls is dict:
            if not batch:
                return None
            batch = next(iter(batch.values()))
            continue
        shape = getattr(batch, "shape", None)
        if shape is not None:
            return shape[0] if len(shape) else None
        if isinstance(batch, (tuple, list)):  # named tuples, list subclasses
            if not batch:
                return None
            batch = batch[0]
        elif isinstance(batch, Mapping):  # e.g. a tokenizer's BatchEncoding
            if not batch:
                return None
            batch = next(iter(batch.values()))
        else:
            return None
    return None


def wrap_next(original: Any) -> Any:
    """``_BaseDataLoaderIter.__next__``, timed, with the grad mode the batch was fetched in
    (``torch.is_grad_enabled``: tens of ns).

    The usual batches (a tensor, or a tuple, list or dict whose first item is one) are sized
    inline, the rest by :func:`batch_size_of`: in a tiny-ops model's steps, with the hook's
    code and data cold, the call took the wrapper's own time from 4.1-4.7 to 2.6-2.9 µs."""
    from torch import Tensor, is_grad_enabled

    def __next__(self: Any) -> Any:
        began = _clock()
        try:
            batch = original(self)
        except StopIteration:
            _append((EXHAUSTED, began, _clock(), id(self)))
            raise
        ended = _clock()
        cls = type(batch)
        if cls is tuple or cls is list:
            first = batch[0] if batch else None
        elif cls is dict:
            first = next(iter(batch.values()), None)
        else:
            first = batch
        if type(first) is Tensor:
            shape = first.shape
            size = shape[0] if shape else None
        else:
            size = batch_size_of(batch)
        _append((BATCH, began, ended, id(self), size, is_grad_enabled()))
        HOOK_S[0] += _clock() - ended
        return batch

    __next__.__wrapped__ = original  # type: ignore[attr-defined]
    __next__.__qualname__ = getattr(original, "__qualname__", "__next__")
    __next__._torchtop = True  # type: ignore[attr-defined]
    return __next__


def wrap_init(original: Any) -> Any:
    """``_BaseDataLoaderIter.__init__``, which leaves weak references to iterator and loader
    and the loader's settings (read now: the loader may be gone by the time the sampler looks,
    when the job iterates it at its very end). Once per iterator, so once per epoch at most."""

    def __init__(self: Any, loader: Any, *args: Any, **kwargs: Any) -> None:
        original(self, loader, *args, **kwargs)
        try:
            dataset_id = id(getattr(loader, "dataset", None))
            event = (ITERATOR, _clock(), id(self), weakref.ref(self), id(loader))
            _append((*event, weakref.ref(loader), settings_of(loader), dataset_id))
        except Exception:  # e.g. not weakly referenceable: its batches still count, unnamed
            pass

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    __init__.__qualname__ = getattr(original, "__qualname__", "__init__")
    __init__._torchtop = True  # type: ignore[attr-defined]
    return __init__


# -- the sampler thread's side ---------------------------------------------------------------


def settings_of(loader: Any) -> dict[str, Any]:
    """What the loader panel and the report show of a DataLoader's configuration."""
    batch_size = getattr(loader, "batch_size", None)
    if batch_size is None:
        batch_size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    num_workers = int(getattr(loader, "num_workers", 0) or 0)
    context = getattr(loader, "multiprocessing_context", None)
    return {
        "dataset": type(getattr(loader, "dataset", None)).__name__,
        "batch_size": batch_size if isinstance(batch_size, int) else None,
        "num_workers": num_workers,
        "pin_memory": bool(getattr(loader, "pin_memory", False)),
        "prefetch_factor": getattr(loader, "prefetch_factor", None) if num_workers else None,
        "persistent_workers": bool(getattr(loader, "persistent_workers", False)),
        # A concrete context knows its name; never ask multiprocessing for its default,
        # which would fix the job's start method.
        "start_method": getattr(context, "_name", None),
    }


#: A Python container with at least this many items is taken to hold the dataset's data.
BIG_CONTAINER = 1000
#: Attributes of a dataset looked at, and how deep into wrapped datasets (``Subset.dataset``).
MAX_ATTRIBUTES = 32
MAX_DEPTH = 2
_CONTAINERS = (list, tuple, dict, set, frozenset)
#: Modules whose objects hold their data outside Python objects (one buffer, shared pages).
_ARRAY_MODULES = frozenset({"numpy", "torch", "pyarrow", "h5py", "zarr"})


def _array_kind(value: Any) -> tuple[str, str] | None:
    """An array of a known library: ``("python", …)`` for a NumPy array of Python objects,
    ``("arrays", …)`` for one of numbers (or a tensor, an Arrow table, a memory map)."""
    cls = type(value)
    library = cls.__module__.split(".")[0]
    if library not in _ARRAY_MODULES:
        return None
    dtype = getattr(value, "dtype", None)
    if dtype is None and library != "pyarrow":  # a torch Dataset, a module: not an array
        return None
    if getattr(dtype, "hasobject", False):
        return "python", f"a NumPy array of Python objects ({cls.__name__}, dtype object)"
    what = (
        "a memory-mapped array" if cls.__name__ == "memmap" else f"{cls.__module__}.{cls.__name__}"
    )
    return "arrays", what


def _container_kind(value: Any) -> tuple[str, str] | None:
    """A big Python container: ``("python", "list of 1,200,000 dict")`` unless its items are
    arrays (a list of arrays keeps their data in shared buffers); ``None`` for a small one."""
    # Exact types only: a subclass's __len__ or __getitem__ is the job's code, never run here.
    if type(value) not in _CONTAINERS or len(value) < BIG_CONTAINER:
        return None
    items: list[Any]
    if isinstance(value, dict):
        items = [next(iter(value.values()))]
    elif isinstance(value, (set, frozenset)):
        items = [next(iter(value))]
    else:
        items = [value[0], value[len(value) // 2], value[-1]]
    kinds = [_array_kind(item) for item in items]
    if all(kind is not None and kind[0] == "arrays" for kind in kinds):
        return "arrays", f"{type(value).__name__} of {len(value):,} arrays"
    return "python", f"{type(value).__name__} of {len(value):,} {type(items[0]).__name__}"


def dataset_storage(dataset: Any, depth: int = 0) -> tuple[str, str] | None:
    """What a dataset keeps its data in, from its type and its attributes' types (a few
    items sampled): ``("python", "list of 1,200,000 dict in .rows")`` where a big Python
    container (or a NumPy array of objects) holds it, which forked workers copy page by page;
    ``("arrays", …)`` where only arrays, tensors or memory maps do; ``None`` where nothing big
    was found. Reads attributes as stored (no property runs) and never raises."""
    try:
        found = _array_kind(dataset) or _container_kind(dataset)
        if found is not None:
            return found[0], f"{found[1]} (the dataset itself)"
        attributes = getattr(dataset, "__dict__", None)
        if not isinstance(attributes, dict):
            return None
        arrays: tuple[str, str] | None = None
        for name, value in list(itertools.islice(attributes.items(), MAX_ATTRIBUTES)):
            found = _array_kind(value) or _container_kind(value)
            if found is None and depth < MAX_DEPTH and hasattr(type(value), "__getitem__"):
                inner = dataset_storage(value, depth + 1)  # Subset.dataset and the like
                found = (inner[0], f"{inner[1]} of .{name}") if inner else None
            elif found is not None:
                found = (found[0], f"{found[1]} in .{name}")
            if found is not None and found[0] == "python":
                return found
            arrays = arrays or found
        return arrays
    except Exception:  # a dataset changing under the read, an odd __dict__: not known
        return None


@dataclass
class _Loader:
    index: int
    settings: dict[str, Any]
    ref: Any  # weakref to the DataLoader
    dataset_id: int
    #: The settings as first read, to recognise a DataLoader made anew with the same ones.
    initial: dict[str, Any] = field(default_factory=dict)
    iterator: Any = None  # weakref to its latest iterator
    batches: int = 0
    samples: int = 0
    wait_s: float = 0.0
    epochs: int = 0
    first_batch_s: float = 0.0
    last_first_batch_s: float | None = None
    grad_batches: int = 0
    changed: bool = True
    workers: list[WorkerStats] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.ref() is not None

    def stats(self) -> LoaderStats:
        s = self.settings
        return LoaderStats(
            index=self.index,
            name=f"loader {self.index}",
            dataset=s["dataset"],
            batch_size=s["batch_size"],
            num_workers=s["num_workers"],
            pin_memory=s["pin_memory"],
            prefetch_factor=s["prefetch_factor"],
            persistent_workers=s["persistent_workers"],
            start_method=s["start_method"],
            batches=self.batches,
            samples=self.samples,
            wait_s=round(self.wait_s, 6),
            epochs=self.epochs,
            first_batch_s=round(self.first_batch_s, 6),
            last_first_batch_s=(
                None if self.last_first_batch_s is None else round(self.last_first_batch_s, 6)
            ),
            workers=list(self.workers),
            grad_batches=self.grad_batches,
            dataset_storage=s.get("dataset_storage"),
            dataset_detail=s.get("dataset_detail"),
        )


class LoaderTracker:
    """Names each DataLoader, totals its waits, and reads its workers (at a low rate)."""

    def __init__(self) -> None:
        self.loaders: list[_Loader] = []
        self._by_id: dict[int, _Loader] = {}
        #: iterator id -> (weakref to the iterator, its loader)
        self._iterators: dict[int, tuple[Any, _Loader | None]] = {}
        #: Iterators whose first batch has not come yet.
        self._fresh: set[int] = set()
        #: Iterators that ran out: their next batch starts an epoch (persistent workers).
        self._exhausted: set[int] = set()
        self._procs: dict[int, Any] = {}
        self._next_index = 0
        #: An iterator with workers appeared since the last read: read them soon, not in a
        #: second (a short epoch's workers would be missed).
        self.workers_started = False

    # -- events ----------------------------------------------------------------------------

    def iterator_created(
        self,
        iterator_id: int,
        iterator_ref: Any,
        loader_id: int,
        loader_ref: Any,
        settings: dict[str, Any],
        dataset_id: int,
    ) -> None:
        entry = self._loader_for(loader_id, loader_ref, settings, dataset_id)
        self._iterators[iterator_id] = (iterator_ref, entry)
        self._fresh.add(iterator_id)
        self._exhausted.discard(iterator_id)  # a new iterator where a spent one lived
        if entry is not None:
            entry.iterator = iterator_ref
            entry.epochs += 1
            entry.changed = True
            if entry.settings["num_workers"]:
                self.workers_started = True

    def batch(
        self, iterator_id: int, wait: float, samples: int | None, grad: bool = False
    ) -> tuple[bool, int | None]:
        """Count a batch (``grad``: fetched with grad mode on); return whether it was its
        iterator's first, and the loader index."""
        known = self._iterators.get(iterator_id)
        if known is None:
            # An iterator created before the hooks were installed: its first batch seen is
            # taken as its first, and it stays unnamed.
            self._iterators[iterator_id] = (None, None)
            first = True
        else:
            first = iterator_id in self._fresh
        self._fresh.discard(iterator_id)
        entry = known[1] if known is not None else None
        if entry is None:
            return first, None
        if iterator_id in self._exhausted:  # reset for another epoch: no workers started
            self._exhausted.discard(iterator_id)
            entry.epochs += 1
        entry.batches += 1
        entry.samples += samples or 0
        entry.grad_batches += grad
        if first:
            entry.first_batch_s += wait
            entry.last_first_batch_s = wait
        else:
            entry.wait_s += wait
        entry.changed = True
        return first, entry.index

    def exhausted(self, iterator_id: int, wait: float) -> None:
        known = self._iterators.get(iterator_id)
        if known is not None and known[1] is not None:
            known[1].wait_s += wait
            known[1].changed = True
            self._exhausted.add(iterator_id)

    def _loader_for(
        self, loader_id: int, loader_ref: Any, settings: dict[str, Any], dataset_id: int
    ) -> _Loader:
        loader = loader_ref()
        entry = self._by_id.get(loader_id)
        # The same live loader; or, both gone, the one that lived at this id (its iterator's
        # event is read after the loader was freed, as at the job's very end).
        if entry is not None and entry.ref() is loader:
            return entry
        # A DataLoader made anew (each epoch, say) over the same dataset is the same loader.
        for old in self.loaders:
            if not old.alive and old.dataset_id == dataset_id and old.initial == settings:
                old.ref = loader_ref
                self._by_id[loader_id] = old
                return old
        entry = _Loader(self._next_index, dict(settings), loader_ref, dataset_id, settings)
        # Once per loader, in the sampler thread: what its dataset keeps its data in.
        storage = dataset_storage(getattr(loader, "dataset", None)) if loader is not None else None
        if storage is not None:
            entry.settings["dataset_storage"], entry.settings["dataset_detail"] = storage
        self._next_index += 1
        self.loaders.append(entry)
        self._by_id[loader_id] = entry
        if len(self.loaders) > MAX_LOADERS:
            gone = next((x for x in self.loaders if not x.alive), self.loaders[0])
            self.loaders.remove(gone)
            for key in [k for k, v in self._by_id.items() if v is gone]:
                del self._by_id[key]
        return entry

    # -- the low-rate read -----------------------------------------------------------------

    def prune(self) -> None:
        """Forget iterators that are gone."""
        for key, (ref, _entry) in list(self._iterators.items()):
            if ref is None or ref() is None:
                del self._iterators[key]
                self._fresh.discard(key)
                self._exhausted.discard(key)

    def read_workers(self) -> None:
        """Each loader's current workers: alive, CPU % and RSS (psutil, by pid)."""
        self.workers_started = False
        seen: set[int] = set()
        for entry in self.loaders:
            iterator = entry.iterator() if entry.iterator is not None else None
            if iterator is None:
                if entry.workers:
                    entry.workers = []
                    entry.changed = True
                continue
            workers = []
            for process in list(getattr(iterator, "_workers", None) or ()):
                pid = getattr(process, "pid", None)
                if not isinstance(pid, int):
                    continue
                seen.add(pid)
                workers.append(self._worker(pid))
                if entry.settings["start_method"] is None:
                    # Read what the worker was started with; never ask multiprocessing, which
                    # may answer by fixing a default for the job.
                    popen = getattr(process, "_popen", None)
                    method = getattr(popen, "method", None)
                    if isinstance(method, str):
                        entry.settings["start_method"] = method
            if workers or entry.workers:
                entry.workers = workers
                entry.changed = True
        for pid in list(self._procs):
            if pid not in seen:
                del self._procs[pid]

    def _worker(self, pid: int) -> WorkerStats:
        import psutil

        proc = self._procs.get(pid)
        try:
            if proc is None:
                proc = psutil.Process(pid)
                self._procs[pid] = proc
                proc.cpu_percent(None)  # the first call starts the measurement; until the
                # next read, the average since the worker started (an epoch may be short)
                times = proc.cpu_times()
                age = time.time() - proc.create_time()
                cpu = round(100 * (times.user + times.system) / age, 1) if age > 0.05 else None
            else:
                cpu = proc.cpu_percent(None)
            with proc.oneshot():
                alive = proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
                rss = proc.memory_info().rss if alive else None
        except (psutil.Error, OSError):
            return WorkerStats(pid=pid, alive=False)
        return WorkerStats(pid=pid, alive=alive, cpu_percent=cpu if alive else None, rss_bytes=rss)

    def frame(self, now: float, *, force: bool = False) -> LoaderInfo | None:
        """The ``loaders`` frame when anything changed (or ``force``), else ``None``."""
        if not self.loaders:
            return None
        if not force and not any(entry.changed for entry in self.loaders):
            return None
        for entry in self.loaders:
            entry.changed = False
        return LoaderInfo(t=now, loaders=[entry.stats() for entry in self.loaders])


def read_safely(tracker: LoaderTracker) -> None:
    """Prune and read workers, ignoring a worker list that changes under our feet."""
    with contextlib.suppress(RuntimeError):
        tracker.prune()
        tracker.read_workers()
