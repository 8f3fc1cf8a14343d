"""What holds the memory: the bytes of the job's parameters, their gradients and optimizer state.

The agent already hooks every optimizer's ``step``; the pre-hook hands the optimizer to
:func:`note_optimizer`, which keeps it in a weak set (a set add per step, nothing more). The
sampler thread calls :meth:`HolderReader.read` at most once per :data:`READ_INTERVAL_S`: it
walks the optimizers' ``param_groups``, each parameter's ``.grad`` and every tensor in
``optimizer.state``, and sums, per device, the bytes of each **unique storage** (keyed by the
storage's data pointer and device), so tied or shared weights, and views of one buffer, count
once. A storage met under several categories counts under the first: parameters, then
gradients, then optimizer state.

Never run in the training thread. The training thread may change ``optimizer.state`` while it
is read (the first step creates it); a read that meets a dictionary changing under it gives up
and is tried again at the next interval rather than report a partial figure.

Parameters not under any optimizer (frozen, or a model used only for inference) are not seen:
they fall in "other allocated".
"""

from __future__ import annotations

import bisect
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from torchtop.protocol import DeviceHolding, MemoryHolders

#: Seconds between two reads at most: the walk is cheap but proportional to the tensors.
READ_INTERVAL_S = 1.0

#: The optimizers whose ``step`` ran, weakly: an optimizer the job drops is forgotten.
_OPTIMIZERS: weakref.WeakSet[Any] = weakref.WeakSet()

CATEGORIES = ("parameters", "gradients", "optimizer_state")


def note_optimizer(optimizer: Any) -> None:
    """Remember an optimizer whose step ran (called from the step pre-hook: a set add)."""
    try:
        _OPTIMIZERS.add(optimizer)
    except TypeError:  # an optimizer that cannot be weakly referenced: not counted
        pass


def optimizer_pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
    """The global step pre-hook: note the optimizer, change nothing."""
    note_optimizer(optimizer)


def forget_all() -> None:
    """Forget every optimizer (the hooks are removed)."""
    _OPTIMIZERS.clear()


@dataclass
class DeviceHolders:
    """Bytes held on one device by unique storage, per category."""

    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0

    def add(self, category: str, nbytes: int) -> None:
        setattr(self, category, getattr(self, category) + nbytes)


@dataclass
class Holders:
    """One read: per device (``"cpu"``, ``"cuda:0"``...), and the storages seen by category.

    ``pointers`` maps ``(device, data_ptr)`` to ``(category, nbytes)``: what the OOM capture
    uses to attribute a snapshot's blocks by address.
    """

    devices: dict[str, DeviceHolders] = field(default_factory=dict)
    pointers: dict[tuple[str, int], tuple[str, int]] = field(default_factory=dict)
    optimizers: int = 0


def _tensors(value: Any) -> Iterator[Any]:
    """The tensors in an optimizer state entry (tensors, or lists/tuples/dicts of them)."""
    if hasattr(value, "untyped_storage"):
        yield value
    elif isinstance(value, dict):
        for item in list(value.values()):
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _walk(optimizers: Iterable[Any]) -> Iterator[tuple[str, Any]]:
    optimizers = list(optimizers)
    for optimizer in optimizers:
        for group in list(optimizer.param_groups):
            for param in list(group["params"]):
                yield "parameters", param
    for optimizer in optimizers:
        for group in list(optimizer.param_groups):
            for param in list(group["params"]):
                grad = param.grad
                if grad is not None:
                    yield "gradients", grad
    for optimizer in optimizers:
        for entry in list(optimizer.state.values()):
            for tensor in _tensors(entry):
                yield "optimizer_state", tensor


def read_holders(optimizers: Iterable[Any]) -> Holders:
    """Sum the unique storages of the optimizers' parameters, gradients and state, per device.

    Raises ``RuntimeError`` when a dictionary changed while it was read (try again later).
    """
    optimizers = list(optimizers)
    out = Holders(optimizers=len(optimizers))
    for category, tensor in _walk(optimizers):
        if getattr(tensor, "is_sparse", False) or tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            continue
        device = str(tensor.device)
        key = (device, storage.data_ptr())
        if key in out.pointers:
            continue
        out.pointers[key] = (category, nbytes)
        out.devices.setdefault(device, DeviceHolders()).add(category, nbytes)
    return out


class HolderReader:
    """Reads the noted optimizers at most once per interval, in the sampler thread."""

    def __init__(self, interval_s: float = READ_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._next = 0.0
        #: The last complete read (``None`` before the first optimizer step).
        self.last: Holders | None = None
        #: Reads given up because the training thread changed a dictionary meanwhile.
        self.retries = 0
        #: Off under ``--memory-limit``: reading storages from this thread while the emulated
        #: device's tracker frees them crashed the job (1 run in 3 of ``torchtop demo oom``).
        #: The read at the failure, in the failing thread, stays.
        self.live = True

    def read(self, now: float | None = None) -> Holders | None:
        """A fresh read when the interval has passed, else ``None``."""
        now = time.monotonic() if now is None else now
        if not self.live or now < self._next:
            return None
        self._next = now + self.interval_s
        optimizers = list(_OPTIMIZERS)
        if not optimizers:
            return None
        try:
            holders = read_holders(optimizers)
        except Exception:  # "dictionary changed size during iteration", an odd optimizer:
            self.retries += 1  # next time, and never the job's or the sampler's failure
            return None
        self.last = holders
        return holders

    def frame(self, t: float, now: float | None = None) -> MemoryHolders | None:
        """A ``holders`` frame when a fresh read was made (see :meth:`read`)."""
        holders = self.read(now)
        if holders is None:
            return None
        return MemoryHolders(
            t=t,
            optimizers=holders.optimizers,
            devices=[
                DeviceHolding(
                    device=device,
                    parameters=held.parameters,
                    gradients=held.gradients,
                    optimizer_state=held.optimizer_state,
                )
                for device, held in sorted(holders.devices.items())
            ],
        )


def read_now() -> Holders | None:
    """A read at once, for a capture (the job is failing or stopped for a snapshot: the
    state is whatever it is now, the first step's included). ``None`` if none or it failed."""
    optimizers = list(_OPTIMIZERS)
    if not optimizers:
        return None
    try:
        return read_holders(optimizers)
    except Exception:
        return None


def split_blocks(
    segments: Iterable[Mapping[str, Any]], holders: Holders, device: str, allocated: int | None
) -> dict[str, int]:
    """Attribute a snapshot's allocated blocks by address: a block holding the data pointer
    of a parameter, gradient or optimizer-state storage on ``device`` counts under that
    category (parameters first, then gradients, then state); the rest of ``allocated`` (the
    blocks' sum when not given) is ``other_allocated``. The four sum to allocated."""
    blocks = sorted(
        (int(block["address"]), int(block["size"]))
        for segment in segments
        for block in segment.get("blocks", ())
        if block.get("state") == "active_allocated"
    )
    starts = [start for start, _ in blocks]
    claimed: set[int] = set()
    split = dict.fromkeys(CATEGORIES, 0)
    order = {category: rank for rank, category in enumerate(CATEGORIES)}
    mine = sorted(
        (
            (order[category], pointer)
            for (dev, pointer), (category, _) in holders.pointers.items()
            if dev == device
        )
    )
    for rank, pointer in mine:
        i = bisect.bisect_right(starts, pointer) - 1
        if i < 0 or i in claimed:
            continue
        start, size = blocks[i]
        if pointer < start + size:
            claimed.add(i)
            split[CATEGORIES[rank]] += size
    total = sum(size for _, size in blocks) if allocated is None else allocated
    split["other_allocated"] = max(0, total - sum(split.values()))
    return split
