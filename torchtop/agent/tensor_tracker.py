"""Exact live and peak bytes of tensor storages created inside a block of code, on any device.

The CUDA caching allocator reports peak memory for free; on CPU there is nothing comparable
that counts tensors only (RSS includes the interpreter, the allocator's slack and every
library). :class:`TensorTracker` fills that gap for measurements such as the demos' "peak
memory" column::

    with TensorTracker() as tr:
        y = (x * 2).sum()
    tr.peak_bytes   # the most bytes of tensor storage alive at once inside the block
    tr.live_bytes   # what is still alive now

What it counts and what it does not:

- Every tensor returned by an ATen operator while the tracker is active, counted by its
  storage: a view (``view``, slicing, ``expand``, ``t``...) shares its base's storage and adds
  nothing, and a storage is subtracted when the last tensor that references it dies, which may
  be after the block ends.
- Tensors that existed before the block are **not** counted, nor are views of them or in-place
  changes to them. If ``resize_`` (or an ``out=`` argument) makes such a tensor allocate a new,
  larger buffer inside the block, that new buffer is counted, since it was allocated there.
  ``resize_`` on a counted storage updates its size.
- Zero-size and ``meta`` tensors, and tensors without a plain storage (sparse, for example)
  are ignored. Memory a kernel uses internally and frees before it returns is not seen, and
  neither is ``UntypedStorage.resize_`` called directly (it does not pass through the
  dispatcher).
- Only the thread that entered the tracker is tracked (dispatch modes are per-thread).

Cost: every operator goes through Python. On a loop of tiny CPU ops (``a + b`` on 16 floats,
2 CPU cores) it measured 15 to 30 times slower than without the tracker: about 1.3 us an op
without, 20 to 35 us with (``tests/unit/test_tensor_tracker.py::test_overhead_is_reported`` prints
the figure). A third to a half of that is the dispatch mode itself, before any counting. On large
tensors the per-op cost is lost in the kernel time. That is why it is opt-in and never on in a
user's job: the demos run their timing pass without it and a separate pass with it for memory.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Operators whose output is a tensor made outside the dispatcher (``torch.tensor([...])``
#: builds it, then lifts it): its storage is new even though the input holds it too.
_LIFT_OPS = frozenset({"lift_fresh", "lift_fresh_copy", "lift"})


class _Entry:
    """One counted storage: its current key and size, and a weak reference to it."""

    __slots__ = ("__weakref__", "key", "nbytes", "ref", "site")

    def __init__(self, key: tuple[str, int], nbytes: int, ref: weakref.ref[Any]) -> None:
        self.key: tuple[str, int] | None = key
        self.nbytes = nbytes
        self.ref = ref
        #: Where the job allocated it, for subclasses that record sites (see ``_site``).
        self.site: Any = None


def _leaves(tree: Any, found: list[Any] | None = None) -> list[Any]:
    """The tensors and storages in an op's arguments or results (nested in lists, tuples, dicts).

    A hand-written walk: ``torch.utils._pytree`` is general but costs several microseconds a
    call, which on tiny ops is most of the tracker's overhead.
    """
    if found is None:
        found = []
    if isinstance(tree, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
        found.append(tree)
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            _leaves(item, found)
    elif isinstance(tree, dict):
        for item in tree.values():
            _leaves(item, found)
    return found


def _storage_of(leaf: Any) -> Any | None:
    """The untyped storage of a tensor or storage, or None when it has no countable one."""
    if isinstance(leaf, torch.UntypedStorage):
        storage: Any = leaf
    elif isinstance(leaf, torch.TypedStorage):
        storage = leaf.untyped()
    else:
        if leaf.device.type == "meta" or leaf.is_sparse:
            return None
        try:
            storage = leaf.untyped_storage()
        except (RuntimeError, NotImplementedError):  # nested, sparse-compressed, odd subclasses
            return None
    return None if storage.device.type == "meta" else storage


def _key(storage: Any) -> tuple[str, int]:
    return (str(storage.device), int(storage.data_ptr()))


class TensorTracker(TorchDispatchMode):
    """Live and peak bytes of tensor storages created while active. See the module docstring.

    Reading ``live_bytes`` and ``peak_bytes`` is valid inside and after the block; storages
    that die after the block still lower ``live_bytes``.
    """

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.RLock()  # finalizers may run in another thread's GC
        #: Counted storages by (device, data_ptr): one entry per storage, however many views.
        self._entries: dict[tuple[str, int], _Entry] = {}
        #: The same entries by id() of the storage's Python object, which PyTorch keeps unique
        #: and alive for as long as the storage lives; lets ``resize_`` find a moved storage.
        self._by_object: dict[int, _Entry] = {}
        self._mutable_cache: dict[Any, bool] = {}
        self._live = 0
        self._peak = 0

    @property
    def live_bytes(self) -> int:
        """Bytes of counted storages alive now."""
        return self._live

    @property
    def peak_bytes(self) -> int:
        """The most bytes of counted storages alive at once since creation or ``reset_peak``."""
        return self._peak

    @property
    def live_storages(self) -> int:
        """How many counted storages are alive now."""
        return len(self._by_object)

    def reset_peak(self) -> None:
        """Start a new peak from the current live bytes."""
        with self._lock:
            self._peak = self._live

    # -- the dispatch hook ----------------------------------------------------------------

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        mutable = self._is_mutable(func)
        before: set[tuple[str, int]] | None = None
        moved: list[_Entry] = []
        if mutable:
            # In-place, out= and resize_ ops may reallocate an input's storage: remember what
            # the inputs pointed at before, so a buffer that appears is recognised as new.
            before, moved = self._inputs_before(args, kwargs)
        out = func(*args, **kwargs)
        outputs = _leaves(out)
        if not outputs:
            return out
        fresh: list[tuple[Any, tuple[str, int], int]] = []
        with self._lock:
            for moved_entry in moved:
                self._refresh(moved_entry)
            lifted = func.overloadpacket.__name__ in _LIFT_OPS
            inputs_after: set[tuple[str, int]] | None = None
            for leaf in outputs:
                storage = _storage_of(leaf)
                if storage is None:
                    continue
                nbytes = int(storage.nbytes())
                if nbytes == 0:
                    continue
                key = _key(storage)
                entry = self._entries.get(key)
                if entry is not None and entry.ref() is storage:
                    continue  # a view, or an in-place op on a counted storage
                if not lifted:
                    if before is None:
                        if inputs_after is None:
                            inputs_after = self._keys_of(_leaves((args, kwargs)))
                        existing = inputs_after
                    else:
                        existing = before
                    if key in existing:
                        continue  # a pre-existing storage (a view of it, or changed in place)
                if any(key == seen for _, seen, _ in fresh):
                    continue  # two outputs of this op on one new storage
                fresh.append((storage, key, nbytes))
        if fresh:
            # Outside the lock: a subclass may refuse the allocation here (and take its time).
            self._admit(sum(nbytes for _, _, nbytes in fresh), func)
            with self._lock:
                for storage, key, nbytes in fresh:
                    self._add(storage, key, nbytes)
        return out

    def _admit(self, nbytes: int, func: Any) -> None:
        """Called with the bytes an op's new storages take, before they are counted. A
        subclass may raise here to refuse them (the memory-limit emulation does)."""

    def _site(self) -> Any:
        """What to remember of where a new storage was allocated; ``None`` here."""
        return None

    # -- bookkeeping ----------------------------------------------------------------------

    def _is_mutable(self, func: Any) -> bool:
        cached = self._mutable_cache.get(func)
        if cached is None:
            try:
                cached = bool(func._schema.is_mutable)
            except AttributeError:
                cached = True  # unknown: take the careful path
            self._mutable_cache[func] = cached
        return cached

    @staticmethod
    def _keys_of(leaves: list[Any]) -> set[tuple[str, int]]:
        keys = set()
        for leaf in leaves:
            storage = _storage_of(leaf)
            if storage is not None:
                keys.add(_key(storage))
        return keys

    def _inputs_before(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[set[tuple[str, int]], list[_Entry]]:
        keys: set[tuple[str, int]] = set()
        counted: list[_Entry] = []
        with self._lock:
            for leaf in _leaves((args, kwargs)):
                storage = _storage_of(leaf)
                if storage is None:
                    continue
                keys.add(_key(storage))
                entry = self._by_object.get(id(storage))
                if entry is not None and entry.ref() is storage:
                    counted.append(entry)
        return keys, counted

    def _add(self, storage: Any, key: tuple[str, int], nbytes: int) -> None:
        existing = self._by_object.get(id(storage))
        if existing is not None and existing.ref() is storage:
            self._refresh(existing)  # a counted storage that moved (defensive; see _refresh)
            return
        entry = _Entry(key, nbytes, weakref.ref(storage))
        entry.site = self._site()
        self._entries[key] = entry
        self._by_object[id(storage)] = entry
        self._live += nbytes
        if self._live > self._peak:
            self._peak = self._live
        # Runs when PyTorch frees the storage, i.e. when the last tensor using it dies.
        finalizer = weakref.finalize(storage, self._released(), entry, id(storage))
        finalizer.atexit = False

    def _released(self) -> Callable[[_Entry, int], None]:
        # The callback holds the tracker weakly, so a forgotten tracker can be collected even
        # while storages it counted are still alive.
        tracker_ref = weakref.ref(self)

        def release(entry: _Entry, object_id: int) -> None:
            tracker = tracker_ref()
            if tracker is not None:
                tracker._release(entry, object_id)

        return release

    def _release(self, entry: _Entry, object_id: int) -> None:
        with self._lock:
            if entry.key is not None and self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
            if self._by_object.get(object_id) is entry:
                del self._by_object[object_id]
            self._live -= entry.nbytes
            entry.nbytes = 0
            entry.key = None

    def _refresh(self, entry: _Entry) -> None:
        """Re-read a counted storage after an op that may have resized or moved it."""
        storage = entry.ref()
        if storage is None:
            return
        nbytes = int(storage.nbytes())
        key = _key(storage) if nbytes else None
        if key != entry.key:
            if entry.key is not None and self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
            if key is not None:
                self._entries[key] = entry
            entry.key = key
        self._live += nbytes - entry.nbytes
        entry.nbytes = nbytes
        if self._live > self._peak:
            self._peak = self._live
