"""Each rank's collectives, read live from torch's flight recorder.

What torch 2.13 (CPU build) really offers, checked on a 2-process gloo job under torchrun:

- ``torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives, onlyActive)`` returns the
  ring as JSON bytes (format ``version`` "2.10"): ``entries`` (one per collective), ``pg_config``,
  ``pg_status``. There is also ``_dump_fr_trace`` (pickle); ``_dump_nccl_trace_json`` exists only
  in CUDA builds.
- **Gloo records**, and on 2.13 it records by default: the ring holds entries with no variable
  set. ``TORCH_FR_BUFFER_SIZE`` (or the older ``TORCH_NCCL_TRACE_BUFFER_SIZE``) sets the ring's
  length, read when a process group is created; ``0`` turns it off (the dump then fails), ``3``
  keeps the last three.
- Each entry has ``pg_id``, ``process_group`` ``[name, desc]`` ("0"/"default_pg", then "1"/
  "undefined" for a ``new_group``), ``collective_seq_id`` (per process group, from 1),
  ``p2p_seq_id``, ``profiling_name`` ("gloo:all_reduce"), ``input_sizes``/``output_sizes``,
  dtypes, ``record_id`` (increasing per process), ``state`` and ``time_created_ns`` (the
  enqueue, on the wall clock). On gloo ``time_discovered_started_ns`` and
  ``time_discovered_completed_ns`` stay 0 and ``state`` stays "scheduled" even once the work is
  done (``retired`` turns true): **gloo gives the enqueue time only**, no start or completion.
- Ranks are therefore compared on their enqueue times (arrivals), which are on each node's wall
  clock: the comparison is valid within a node (all ranks of a node share its clock), and across
  nodes only as far as their clocks agree (see :mod:`torchtop.model.collectives`).

This module turns the recorder on before the process group exists (when the user has not set the
size: theirs is kept) and reads the ring at most once a second, keeping only the entries it has
not sent yet, from each recorder there is: NCCL's own ring (``_dump_nccl_trace_json``, CUDA
builds; NCCL collectives go there only) and the generic one (``_dump_fr_trace_json``: gloo). A
torch with neither has no recorder: :func:`recorder_missing`
says why, and the run keeps the rule based on the time outside ``backward``.

Cost: a full ring of 2000 entries dumps as about 1 MB of JSON; parsing it took about 15 ms
on a 2-core machine at load 1.2 (plus torch's own serialization), once a second at most in the
sampler thread: about 1.5% of a core per rank with a full ring, less while it fills. Measured
side by side since (``python -m benchmarks.rank_overhead --launcher torchrun --recorder both
--rounds 20``, 2 gloo ranks, an MLP of 19 ms steps, load 0.7 to 2): the agent's threads took
0.81% of a core with the recorder off and 6.4% with it on, and the mean step time of the "on"
blocks rose 11% (median 1%): a full ring read whole every second costs more than estimated;
a smaller ring or reading only the newest entries is the next step.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torchtop.agent.probes.base import ProbeUnavailable
from torchtop.agent.rank_site.torchtop_rank_marks import (
    BUFFER_ENV,
    DEFAULT_RING,
    LEGACY_BUFFER_ENV,
    enable_recorder,
)
from torchtop.protocol import CollectiveEntry, CollectivesSeen

__all__ = [
    "BUFFER_ENV",
    "DEFAULT_RING",
    "LEGACY_BUFFER_ENV",
    "Collective",
    "CollectiveMonitor",
    "CollectiveReader",
    "enable_recorder",
    "parse_dump",
    "recorder_missing",
]

#: The most entries one ``collectives`` frame carries.
FRAME_ENTRIES = 500
#: The reader reads at most this often (seconds).
READ_INTERVAL = 1.0
#: Entries awaiting their completion time, at most (a ring's worth).
MAX_PENDING = 4000


@dataclass(frozen=True)
class Collective:
    """One collective as one rank saw it."""

    pg: str
    seq: int
    op: str
    sizes: tuple[tuple[int, ...], ...]
    enqueued_ns: int
    started_ns: int
    completed_ns: int
    record_id: int
    #: The recorder is done with it (gloo retires an entry with no completion time).
    retired: bool = False

    def as_wire(self) -> dict[str, Any]:
        return {
            "pg": self.pg,
            "seq": self.seq,
            "op": self.op,
            "sizes": [list(s) for s in self.sizes],
            "enqueued_ns": self.enqueued_ns,
            "started_ns": self.started_ns,
            "completed_ns": self.completed_ns,
        }


#: The dumps of torch's flight recorders, NCCL's first: ProcessGroupNCCL keeps its own ring
#: (``_dump_nccl_trace_json``, in CUDA builds only), apart from the generic one gloo and the
#: CPU backends record in (``_dump_fr_trace_json``, which holds no NCCL collective).
DUMPS = ("_dump_nccl_trace_json", "_dump_fr_trace_json")


def _dumpers() -> list[Callable[[], bytes]]:
    """One reader per flight recorder this torch has (none: no recorder)."""
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return []
    return [_reading(dump) for name in DUMPS if (dump := getattr(c10d, name, None)) is not None]


def _reading(dump: Callable[[bool, bool], Any]) -> Callable[[], bytes]:
    def read() -> bytes:
        return bytes(dump(True, False))  # every entry, finished ones too

    return read


def _dumper() -> Callable[[], bytes] | None:
    """The generic recorder's dump (gloo, the CPU backends) where this torch has it."""
    dumps = _dumpers()
    return dumps[-1] if dumps else None


def recorder_missing() -> str | None:
    """One line saying why this torch has no flight recorder, or None when it has one."""
    if not _dumpers():
        return (
            "this torch has no flight recorder (no _dump_fr_trace_json nor"
            " _dump_nccl_trace_json in torch._C._distributed_c10d); stragglers are told from"
            " the time outside backward"
        )
    return None


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _sizes(value: object) -> tuple[tuple[int, ...], ...]:
    if not isinstance(value, list):
        return ()
    return tuple(
        tuple(_int(d) for d in shape[:8]) for shape in value[:8] if isinstance(shape, list)
    )


def _pg_name(entry: dict[str, Any]) -> str:
    group = entry.get("process_group")
    if isinstance(group, list) and group and isinstance(group[0], str):
        return group[0][:64]
    return str(_int(entry.get("pg_id")))


def parse_dump(raw: bytes | str) -> list[Collective]:
    """The collectives of one dump (point-to-point entries left out), oldest first."""
    data = json.loads(raw)
    entries = data.get("entries") if isinstance(data, dict) else None
    out: list[Collective] = []
    for entry in entries if isinstance(entries, list) else ():
        if not isinstance(entry, dict) or entry.get("is_p2p"):
            continue
        seq = _int(entry.get("collective_seq_id"))
        if seq <= 0:
            continue
        name = entry.get("profiling_name")
        op = name.rsplit(":", 1)[-1][:48] if isinstance(name, str) else "?"
        out.append(
            Collective(
                pg=_pg_name(entry),
                seq=seq,
                op=op,
                sizes=_sizes(entry.get("input_sizes")),
                enqueued_ns=_int(entry.get("time_created_ns")),
                started_ns=_int(entry.get("time_discovered_started_ns")),
                completed_ns=_int(entry.get("time_discovered_completed_ns")),
                record_id=_int(entry.get("record_id")),
                retired=entry.get("retired") is True,
            )
        )
    out.sort(key=lambda c: c.record_id)
    return out


class CollectiveReader:
    """Reads the ring at most once a second and hands back only what is new.

    An entry is new once its ``record_id`` passes the last one sent; an entry seen while it had
    no completion time yet is sent again once it has one (NCCL with timing fills it later).
    """

    def __init__(
        self,
        dump: Callable[[], bytes] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._dump = dump if dump is not None else _dumper()
        self._clock = clock
        self._last_read = float("-inf")
        self._last_record = -1
        #: Entries sent before their completion was known (NCCL marks it later), by record id.
        self._pending: set[int] = set()
        self.failures = 0

    @property
    def available(self) -> bool:
        return self._dump is not None

    def poll(self) -> list[Collective]:
        """New collectives since the last poll; empty when read less than a second ago."""
        if self._dump is None:
            return []
        now = self._clock()
        if now - self._last_read < READ_INTERVAL:
            return []
        self._last_read = now
        try:
            entries = parse_dump(self._dump())
        except Exception:  # no process group yet, or the ring is off: nothing to read
            self.failures += 1
            return []
        fresh = [c for c in entries if c.record_id > self._last_record]
        if fresh:
            self._last_record = fresh[-1].record_id
        completed = []
        if self._pending:
            in_ring = {c.record_id: c for c in entries if c.record_id in self._pending}
            completed = [c for c in in_ring.values() if c.completed_ns > 0]
            # Done with: completed now, retired without a completion (gloo), or out of the ring.
            self._pending = {i for i, c in in_ring.items() if not (c.completed_ns or c.retired)}
        self._pending.update(c.record_id for c in fresh if not (c.completed_ns or c.retired))
        if len(self._pending) > MAX_PENDING:
            self._pending = set(sorted(self._pending)[-MAX_PENDING:])
        return sorted(completed + fresh, key=lambda c: c.record_id)


def _turned_off(environ: Mapping[str, str]) -> str | None:
    """One line when the job set the ring's size to 0 (no collectives are recorded)."""
    for name in (BUFFER_ENV, LEGACY_BUFFER_ENV):
        if name in environ:
            if environ[name].strip() == "0":
                return (
                    f"the job turned torch's flight recorder off ({name}=0): stragglers are"
                    " told from the time outside backward"
                )
            return None
    return None


def _group_ready() -> bool:
    """torch.distributed is loaded and this process has its default process group."""
    dist = sys.modules.get("torch.distributed")
    try:
        return dist is not None and bool(dist.is_available() and dist.is_initialized())
    except Exception:
        return False


class CollectiveMonitor:
    """The sampler's part: once this process has a process group, reads the recorder (at most
    once a second) and returns one :class:`~torchtop.protocol.CollectivesSeen` with the new
    entries. Never imports torch first. Without a recorder it raises
    :class:`~torchtop.agent.probes.base.ProbeUnavailable` once, with the reason."""

    def __init__(self, reader: CollectiveReader | None = None) -> None:
        #: One reader per recorder (NCCL's and the generic one each number their entries).
        self._readers = [reader] if reader is not None else None

    def tick(self, now: float) -> list[CollectivesSeen]:
        if self._readers is None:
            if not _group_ready():
                return []
            missing = recorder_missing() or _turned_off(os.environ)
            if missing is not None:
                raise ProbeUnavailable(missing)
            self._readers = [CollectiveReader(dump) for dump in _dumpers()]
        fresh = [c for reader in self._readers for c in reader.poll()]
        if not fresh:
            return []
        entries = [
            CollectiveEntry(
                pg=c.pg,
                seq=c.seq,
                op=c.op,
                sizes=[list(s) for s in c.sizes],
                enqueued_ns=c.enqueued_ns,
                started_ns=c.started_ns,
                completed_ns=c.completed_ns,
            )
            for c in fresh
        ]
        # A few hundred bytes an entry at most: frames far below the protocol's limit.
        return [
            CollectivesSeen(t=now, entries=entries[i : i + FRAME_ENTRIES])
            for i in range(0, len(entries), FRAME_ENTRIES)
        ]
