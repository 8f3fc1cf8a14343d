"""What holds the memory: the bytes of the job's parameters, their gradients and optimizer state.

The agent already hooks every optimizer's ``step``. Its step pre-hook calls
:func:`step_seen` here, in the thread that steps the optimizer, which, at most once per
:data:`READ_INTERVAL_S` and only as often as :data:`READ_BUDGET` allows, reads that optimizer:
its parameters, each parameter's ``.grad`` and every tensor in ``optimizer.state``, summed per
device by **unique storage** (keyed by the storage's data pointer and device), so tied or shared
weights, and views of one buffer, count once. A storage met under several categories counts under
the first: parameters, then gradients, then optimizer state. What it keeps is numbers only
(device, data pointer, bytes): no tensor is held.

The sampler thread (:class:`HolderReader`) only merges those numbers; **no thread of the agent
ever touches the job's tensors.** Reading ``param.grad`` from another thread crashes the job:
``param.grad = None`` (what ``optimizer.zero_grad()`` does by default) frees the old gradient's
Python object while the parameter still points at it, and ``THPVariable_clear`` releases the GIL
in the middle of that free; a thread that takes the GIL then and reads ``param.grad`` increfs an
object being freed (segmentation fault in ``TensorImpl::incref_pyobject``, torch 2.13). Any job
that zeroes its gradients to ``None`` is exposed; the ``--memory-limit`` tracker, which runs
Python in every free, made it frequent (1 run in 3 of ``torchtop demo oom``).
``tests/processes/test_holders_race.py`` reproduces it.

The cost falls on the training thread, so it is bounded: a read that took ``c`` seconds is
followed by the next no sooner than ``c / READ_BUDGET`` later (a model with 10,000 parameter
tensors under Adam is read every few seconds instead of every second).

A capture reads afresh where reading is safe: in the thread that steps (an OOM in the job's
forward, backward on the CPU, or step), or inside a backward pass (an OOM in CUDA's backward
thread, while the stepping thread waits for it). Elsewhere (a snapshot on request) it uses the
last step's reads without their gradients: ``zero_grad()`` frees them every step, so their last
addresses may hold anything by then; they count as other allocated.

Parameters under no optimizer (a frozen backbone, an EMA copy, a teacher model) are found
through torch's module parameter registration hook: it runs once per parameter while the job
builds its modules (nothing during training) and keeps the parameter weakly; each read counts
those not under the optimizer as parameters too (``frozen``). That needs the agent to start
before ``torch.nn`` loads (``torchtop run``); a job that built its modules first
(``torchtop.start()`` late in a script) has them missing, and the frame says so
(``modules_seen``). A job that never steps an optimizer (inference only) has no read at all.
"""

from __future__ import annotations

import bisect
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torchtop.agent.steps import BEFORE_AT, HOOK_S
from torchtop.protocol import DeviceHolding, MemoryHolders

#: Seconds between two reads of one optimizer at most, and between two frames.
READ_INTERVAL_S = 1.0
#: The share of the training thread's time the reads may take: after a read of ``c`` seconds
#: the next waits at least ``c / READ_BUDGET``.
READ_BUDGET = 0.001

CATEGORIES = ("parameters", "gradients", "optimizer_state")
#: The order storages are claimed in: parameters, then parameters under no optimizer (counted
#: as parameters in a split), gradients, optimizer state.
READ_ORDER = ("parameters", "frozen", "gradients", "optimizer_state")


@dataclass
class DeviceHolders:
    """Bytes held on one device by unique storage, per category."""

    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    #: Parameters under no optimizer (not in ``parameters`` here; the frame adds them).
    frozen: int = 0

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

    def count(self, category: str, key: tuple[str, int], nbytes: int) -> None:
        """Count a storage under ``category`` unless it was counted already."""
        if key in self.pointers:
            return
        self.pointers[key] = (category, nbytes)
        held = self.devices.get(key[0])
        if held is None:
            held = self.devices[key[0]] = DeviceHolders()
        held.add(category, nbytes)


#: An optimizer's first steps each seen by :func:`step_seen`: its state, made by its first
#: step, is read on the next, not a read interval later.
WATCH_STEPS = 3


class _Noted:
    """What the step pre-hook keeps of one optimizer: its last read, and when to read again."""

    __slots__ = ("cost_s", "next_at", "read", "states", "watch")

    def __init__(self) -> None:
        self.next_at = 0.0
        #: Steps still to be seen one by one, each checked for new state, before the
        #: pre-hook calls only when a read is due (:data:`~torchtop.agent.steps.BEFORE_AT`).
        self.watch = WATCH_STEPS
        #: Entries in ``optimizer.state`` at the last read: a change in the first steps (the
        #: first creates them) calls for a read at once; a later one waits for the next read.
        self.states = -1
        self.read: Holders | None = None
        #: What the last read took, in seconds of the training thread.
        self.cost_s = 0.0


#: The optimizers whose ``step`` ran, weakly: an optimizer the job drops is forgotten.
_NOTED: weakref.WeakKeyDictionary[Any, _Noted] = weakref.WeakKeyDictionary()
#: The thread that ran the last step pre-hook: the one where reading tensors is safe.
_STEPPING = [0]
#: The optimizer of the last step pre-hook (a weak reference) and its record.
_LAST: list[Any] = [None, None]
_get_ident = threading.get_ident
_clock = time.perf_counter
#: Bumped by each read, so that the sampler sends a frame only when there is something new.
_VERSION = [0]
#: Reads that raised (an odd optimizer); the job never sees it.
FAILURES = [0]
#: The parameters of every module built since the hook went in, weakly.
_MODULE_PARAMS: weakref.WeakSet[Any] = weakref.WeakSet()
#: Whether the hook went in before ``torch.nn`` loaded: then every module's parameters were seen.
MODULES_SEEN = [False]


def parameter_registered(module: Any, name: str, param: Any) -> None:
    """Torch's module parameter registration hook: keep the parameter, weakly."""
    if param is not None:
        try:
            _MODULE_PARAMS.add(param)
        except Exception:  # never the job's model building's failure
            pass


def install_module_hook(module_module: Any, seen_all: bool) -> list[Callable[[], None]]:
    """Put :func:`parameter_registered` in (``torch.nn.modules.module``); ``seen_all``: the job
    has built no module yet. Returns what undoes it."""
    handle = module_module.register_module_parameter_registration_hook(parameter_registered)
    MODULES_SEEN[0] = seen_all

    def undo() -> None:
        handle.remove()
        _MODULE_PARAMS.clear()
        MODULES_SEEN[0] = False

    return [undo]


def next_read_at(now: float, cost_s: float, interval_s: float, budget: float) -> float:
    """When the next read may run after one that took ``cost_s`` and ended at ``now``."""
    return now + max(interval_s, cost_s / budget if budget > 0 else interval_s)


def noted() -> list[tuple[Any, _Noted]]:
    """The optimizers noted so far, each with its record (strong references: for
    :func:`restore`)."""
    for _ in range(3):  # the training thread may note an optimizer meanwhile
        try:
            return list(_NOTED.items())
        except RuntimeError:
            continue
    return []


def restore(records: list[tuple[Any, _Noted]], postponed_s: float) -> None:
    """Note again what :func:`noted` returned, each next read ``postponed_s`` later: the hooks
    were out that long (the overhead benchmark's "off" blocks), and the reads are spaced in
    the time they are in, not read again at once."""
    for optimizer, record in records:
        record.next_at += postponed_s
        _NOTED.setdefault(optimizer, record)


def step_seen(optimizer: Any, now: float) -> None:
    """An optimizer's step is about to run (``now``: ``time.perf_counter()``): note the
    optimizer, and read it when due. Called by the agent's step pre-hook
    (:data:`torchtop.agent.steps.BEFORE_STEP`), in the thread that steps the optimizer, the only
    one where its tensors may be read; within that hook's own time."""
    try:
        # Once a step, with the hook's code and data cold after the step's ops: the usual case
        # (the optimizer of the last step) costs a weak reference's call, not a weak dict's
        # lookup (a new reference to hash each time).
        last = _LAST
        ref = last[0]
        if ref is not None and ref() is optimizer:
            noted = last[1]
            _STEPPING[0] = _get_ident()
        else:
            noted = _note(optimizer)
            last[0], last[1] = weakref.ref(optimizer), noted
        if now >= noted.next_at or len(optimizer.state) != noted.states:
            read_due(optimizer, noted, READ_INTERVAL_S, READ_BUDGET)
        if noted.watch:
            noted.watch -= 1
            BEFORE_AT[0] = 0.0  # the next step is seen too
        else:
            BEFORE_AT[0] = noted.next_at
    except Exception:  # cannot be weakly referenced, an odd optimizer: never the job's failure
        FAILURES[0] += 1
        BEFORE_AT[0] = 0.0


def optimizer_pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
    """:func:`step_seen` as a step pre-hook of its own (the agent calls it from its step
    pre-hook instead: one hook a step, not two); changes nothing."""
    now = _clock()
    try:
        step_seen(optimizer, now)
    finally:  # the hook's time, its reads included, is part of the hooks' cost on the step
        HOOK_S[0] += _clock() - now


def _note(optimizer: Any) -> _Noted:
    """The optimizer's record (made at its first step), and this thread as the one stepping."""
    noted = _NOTED.get(optimizer)
    if noted is None:
        noted = _NOTED[optimizer] = _Noted()
    _STEPPING[0] = threading.get_ident()
    return noted


def read_due(
    optimizer: Any,
    noted: _Noted,
    interval_s: float = READ_INTERVAL_S,
    budget: float = READ_BUDGET,
) -> None:
    """Read one optimizer now (in the thread that steps it) and schedule the next read."""
    start = _clock()
    noted.states = len(optimizer.state)
    try:
        holders = read_holders([optimizer])
    except Exception:
        holders = None
        FAILURES[0] += 1
    now = _clock()
    noted.cost_s = now - start
    noted.next_at = next_read_at(now, noted.cost_s, interval_s, budget)
    if holders is None:
        return
    noted.read = holders
    _VERSION[0] += 1


def note_optimizer(optimizer: Any) -> None:
    """Note an optimizer and read it now, as its step pre-hook does when due (for tests).
    Call it in the thread that steps the optimizer."""
    try:
        read_due(optimizer, _note(optimizer))
    except TypeError:  # an optimizer that cannot be weakly referenced: not counted
        pass


def forget_all() -> None:
    """Forget every optimizer (the hooks are removed)."""
    _NOTED.clear()
    _LAST[0] = _LAST[1] = None
    _STEPPING[0] = 0
    BEFORE_AT[0] = 0.0


def _state_tensors(value: Any, tensor_type: type, found: list[Any]) -> None:
    """The tensors in an optimizer state entry (tensors, or lists/tuples/dicts of them)."""
    if isinstance(value, tensor_type):
        found.append(value)
    elif isinstance(value, dict):
        for item in list(value.values()):
            _state_tensors(item, tensor_type, found)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _state_tensors(item, tensor_type, found)


def _count(out: Holders, category: str, tensors: list[Any], names: dict[Any, str]) -> None:
    """Count each tensor's storage once (the loop the read's cost is made of: kept tight)."""
    pointers = out.pointers
    sums: dict[str, int] = {}
    for tensor in tensors:
        device = tensor.device
        name = names.get(device)
        if name is None:
            name = names[device] = str(device)
        if name == "meta":
            continue
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested: no plain storage
            continue
        nbytes = storage.nbytes()
        if not nbytes:
            continue
        key = (name, storage.data_ptr())
        if key in pointers:
            continue
        pointers[key] = (category, nbytes)
        sums[name] = sums.get(name, 0) + nbytes
    for name, nbytes in sums.items():
        held = out.devices.get(name)
        if held is None:
            held = out.devices[name] = DeviceHolders()
        held.add(category, nbytes)


def read_holders(optimizers: Iterable[Any]) -> Holders:
    """Sum the unique storages of the optimizers' parameters, gradients and state, per device.

    **Only in the thread that steps these optimizers** (see the module docstring: ``.grad`` read
    from another thread can crash the job). Raises when the optimizer is odd or a dictionary
    changed while it was read.
    """
    optimizers = list(optimizers)
    out = Holders(optimizers=len(optimizers))
    params = [
        param
        for optimizer in optimizers
        for group in list(optimizer.param_groups)
        for param in list(group["params"])
    ]
    grads = [grad for grad in (param.grad for param in params) if grad is not None]
    under = {id(param) for param in params}
    frozen = [param for param in list(_MODULE_PARAMS) if id(param) not in under]
    state: list[Any] = []
    torch = sys.modules.get("torch")
    if torch is not None:
        for optimizer in optimizers:
            for entry in list(optimizer.state.values()):
                _state_tensors(entry, torch.Tensor, state)
    names: dict[Any, str] = {}
    _count(out, "parameters", params, names)
    _count(out, "frozen", frozen, names)
    _count(out, "gradients", grads, names)
    _count(out, "optimizer_state", state, names)
    return out


def merge(reads: Iterable[tuple[Holders, bool]]) -> Holders:
    """One split from several optimizers' reads, each with whether to count its gradients:
    each storage once, parameters first, then gradients, then optimizer state."""
    reads = list(reads)
    if len(reads) == 1 and reads[0][1]:
        return reads[0][0]  # one optimizer: its read as it is (never changed once made)
    out = Holders(optimizers=len(reads))
    for category in READ_ORDER:
        for read, gradients in reads:
            if category == "gradients" and not gradients:
                continue
            for key, (seen, nbytes) in read.pointers.items():
                if seen == category:
                    out.count(category, key, nbytes)
    return out


class HolderReader:
    """The sampler's side: merges the reads the step pre-hook made, touching no tensor."""

    def __init__(self, interval_s: float = READ_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._next = 0.0
        self._version = 0
        #: The last merged split (``None`` before the first optimizer step).
        self.last: Holders | None = None

    def read(self, now: float | None = None) -> Holders | None:
        """A merged split when the interval has passed and a step read something new."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return None
        self._next = now + self.interval_s
        version = _VERSION[0]
        if version == self._version:
            return None
        reads = _reads()
        if not reads:
            return None
        self._version = version
        self.last = merge((read, True) for read in reads)
        return self.last

    def frame(self, t: float, now: float | None = None) -> MemoryHolders | None:
        """A ``holders`` frame when a fresh split was merged (see :meth:`read`)."""
        holders = self.read(now)
        if holders is None:
            return None
        return MemoryHolders(
            t=t,
            optimizers=holders.optimizers,
            devices=[
                DeviceHolding(
                    device=device,
                    parameters=held.parameters + held.frozen,
                    gradients=held.gradients,
                    optimizer_state=held.optimizer_state,
                    frozen=held.frozen,
                )
                for device, held in sorted(holders.devices.items())
            ],
            modules_seen=MODULES_SEEN[0],
        )


def _reads() -> list[Holders]:
    return [n.read for _, n in noted() if n.read is not None]


def _safe_here() -> bool:
    """Whether this thread may read the job's tensors: the thread that steps, or a thread
    running a backward pass (the stepping thread waits for it; gradients are written there)."""
    if threading.get_ident() == _STEPPING[0]:
        return True
    torch = sys.modules.get("torch")
    try:
        return torch is not None and int(torch._C._current_graph_task_id()) != -1
    except Exception:
        return False


def read_now() -> Holders | None:
    """The split for a capture: a fresh read where it is safe (see :func:`_safe_here`), else
    the last step's reads without their gradients (see the module docstring). ``None`` before
    the first step, or if it failed."""
    try:
        optimizers = list(_NOTED.keys())
        if not optimizers:
            return None
        if _safe_here():
            return read_holders(optimizers)
        noted = list(_NOTED.values())
    except Exception:
        return None
    reads = [(n.read, False) for n in noted if n.read is not None]
    return merge(reads) if reads else None


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
    order["frozen"] = order["parameters"]
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
