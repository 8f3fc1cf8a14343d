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
size: theirs is kept) and reads each recorder there is: NCCL's own ring (CUDA builds; NCCL
collectives go there only) and the generic one (gloo). A torch with neither has no recorder:
:func:`recorder_missing` says why, and the run keeps the rule based on the time outside
``backward``.

**What a read costs, and how it is bounded.** torch 2.13 can only dump the whole ring: both
dumps (``_dump_fr_trace_json(includeCollectives, onlyActive)`` and the pickle
``_dump_fr_trace(includeCollectives, includeStackTraces, onlyActive)``, and NCCL's
``_dump_nccl_trace*``) take no record id to start from. ``FlightRecorder::dump_entries``
(``torch/include/torch/csrc/distributed/c10d/FlightRecorderDetail.hpp``) copies every entry of
the ring under the recorder's lock, then serializes all of them, and the binding **holds the
GIL** the whole time: the job's Python threads wait for it. ``onlyActive`` keeps the entries
without ``time_discovered_completed_``, which gloo never sets: on gloo it returns the whole
ring too. Measured on a full ring of 2000 gloo entries (one process, load 1.5): the JSON dump
25 ms and its parse 14 ms (about 39 ms a read: once a second, about 4% of a core, and the
step time of a job that holds the GIL); the pickle dump without stack traces 11 ms and its load
3.4 ms. So the reader:

- asks first what changed, for nothing: the dump without entries (``includeCollectives``
  false, a few microseconds) holds each group's ``pg_status``, its last enqueued and completed
  sequence ids. The whole ring is read only when they moved since the last read (an idle job,
  or one hung with every rank's last collective already read, costs no read). gloo moves a
  group's last enqueued id before its entry is in the ring (a single-rank loop of all-reduces,
  status then ring read 7,356 times: the ring lacked the status's last collective 2,411 times),
  so a read that does not find it is not taken as up to date and the next one reads again;
- reads the pickle dump, without stack traces, where torch has it (the JSON one elsewhere),
  and turns into collectives only the entries after the last one sent (and those sent before
  their completion, on NCCL): the ring is in record order, so the scan stops at the first entry
  already sent;
- spaces its reads by their cost: after a read that took ``c`` seconds of the sampler
  thread's CPU (what the cost budget counts; the GIL is held throughout, so a step that holds
  the GIL loses as much; wall time would also count the machine's other load) the next waits
  ``c / share`` at least, ``share`` being a fifth of the agent's cost budget
  (``--cost-budget``, 1% of the step time by default, so 0.2%), and one
  second at least. Where that spaces the reads beyond a second, the agent says so once, in the
  ``collectives`` probe's status line (``probes_unavailable.collectives`` in the report), with
  the ring's size and a read's cost; entries that went out of the ring between two reads are
  counted and said too;
- and ``torchtop run`` sets a ring of :data:`DEFAULT_RING` (512) entries where the job set no
  size, instead of torch's 2000: a read costs in proportion to the ring, and 512 entries are
  more than a second of collectives for most jobs (what a read at the budget's pace needs), and
  still several steps of history for torch's own dump after a timeout.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torchtop.agent.holders import next_read_at
from torchtop.agent.probes.base import ProbeUnavailable
from torchtop.agent.rank_site.torchtop_rank_marks import (
    BUFFER_ENV,
    DEFAULT_RING,
    LEGACY_BUFFER_ENV,
    enable_recorder,
)
from torchtop.protocol import CollectiveEntry, CollectivesSeen, ProbeStatus

__all__ = [
    "BUFFER_ENV",
    "DEFAULT_RING",
    "LEGACY_BUFFER_ENV",
    "Collective",
    "CollectiveMonitor",
    "CollectiveReader",
    "Recorder",
    "enable_recorder",
    "parse_dump",
    "recorder_missing",
]

#: The most entries one ``collectives`` frame carries.
FRAME_ENTRIES = 500
#: The reader reads at most this often (seconds).
READ_INTERVAL = 1.0
#: The share of the agent's cost budget (``--cost-budget``) the ring's reads may take.
BUDGET_PART = 0.2
#: The reads' share of the time when no budget is given (a fifth of the default 1%).
READ_SHARE = 0.002
#: The longest the budget spaces two reads (a read of 60 ms, ten times a full default ring's).
MAX_SPACING_S = 30.0
#: Reads with the same status that may miss a group's last enqueued collective before the
#: status is taken as read.
MAX_RETRIES = 3
#: Entries awaiting their completion time, at most (a ring's worth).
MAX_PENDING = 4000
#: The probe whose status line says how the reads are spaced.
PROBE = "collectives"
#: How long the job's exit waits for the sampler's last read of the rings.
FINAL_WAIT_S = 2.0


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


@dataclass(frozen=True)
class Recorder:
    """One flight recorder of this torch: how to read its whole ring, and its groups' status
    alone (no entries: a few microseconds)."""

    read: Callable[[], bytes]
    status: Callable[[], bytes] | None = None


#: The dumps of torch's flight recorders, NCCL's first, each as (pickle, JSON): ProcessGroupNCCL
#: keeps its own ring (in CUDA builds only), apart from the generic one gloo and the CPU
#: backends record in (which holds no NCCL collective). The pickle dump, without stack traces,
#: costs less than half the JSON one, its load included.
DUMPS = (
    ("_dump_nccl_trace", "_dump_nccl_trace_json"),
    ("_dump_fr_trace", "_dump_fr_trace_json"),
)


def _recorders() -> list[Recorder]:
    """One per flight recorder this torch has (none: no recorder)."""
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return []
    out = []
    for pickled_name, json_name in DUMPS:
        pickled = getattr(c10d, pickled_name, None)
        as_json = getattr(c10d, json_name, None)
        if pickled is not None:
            read = _call(pickled, True, False, False)  # entries, no stack traces, finished too
            status = _call(pickled, False, False, False)
        elif as_json is not None:
            read = _call(as_json, True, False)
        else:
            continue
        if as_json is not None:  # the groups' status: JSON's costs less than pickle's
            status = _call(as_json, False, False)
        out.append(Recorder(read, status))
    return out


def _call(dump: Callable[..., Any], *args: bool) -> Callable[[], bytes]:
    def read() -> bytes:
        return bytes(dump(*args))

    return read


def recorder_missing() -> str | None:
    """One line saying why this torch has no flight recorder, or None when it has one."""
    if not _recorders():
        return (
            "this torch has no flight recorder (no _dump_fr_trace nor _dump_nccl_trace in"
            " torch._C._distributed_c10d); stragglers are told from the time outside backward"
        )
    return None


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _sizes(value: object) -> tuple[tuple[int, ...], ...]:
    if not isinstance(value, list | tuple):
        return ()
    return tuple(
        tuple(_int(d) for d in shape[:8]) for shape in value[:8] if isinstance(shape, list | tuple)
    )


def _pg_name(entry: dict[str, Any]) -> str:
    group = entry.get("process_group")
    if isinstance(group, list | tuple) and group and isinstance(group[0], str):
        return group[0][:64]
    return str(_int(entry.get("pg_id")))


class _PlainData(pickle.Unpickler):
    """torch's pickled dump holds dicts, lists, tuples, strings and numbers: no class is
    looked up (nothing runs while it loads)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"the flight recorder's dump names {module}.{name}")


def _load(raw: bytes | str) -> Any:
    """A dump, JSON or pickle (torch's pickle starts with the protocol's ``0x80``)."""
    if isinstance(raw, bytes) and raw[:1] == b"\x80":
        return _PlainData(io.BytesIO(raw)).load()
    return json.loads(raw)


def _entries(data: Any) -> list[Any]:
    entries = data.get("entries") if isinstance(data, dict) else None
    return entries if isinstance(entries, list) else []


def _collective(entry: dict[str, Any]) -> Collective | None:
    if entry.get("is_p2p"):
        return None
    seq = _int(entry.get("collective_seq_id"))
    if seq <= 0:
        return None
    name = entry.get("profiling_name")
    return Collective(
        pg=_pg_name(entry),
        seq=seq,
        op=name.rsplit(":", 1)[-1][:48] if isinstance(name, str) else "?",
        sizes=_sizes(entry.get("input_sizes")),
        enqueued_ns=_int(entry.get("time_created_ns")),
        started_ns=_int(entry.get("time_discovered_started_ns")),
        completed_ns=_int(entry.get("time_discovered_completed_ns")),
        record_id=_int(entry.get("record_id")),
        retired=entry.get("retired") is True,
    )


def _scan(entries: list[Any], after: int) -> tuple[list[Collective], dict[int, int], int]:
    """The collectives recorded after record id ``after`` (point-to-point entries left out),
    oldest first; the newest sequence id seen per group id among them; and the ring's oldest
    record id (-1 when empty). The ring is in record order: the scan goes from its newest entry
    back to the first one at or before ``after``."""
    out: list[Collective] = []
    newest: dict[int, int] = {}
    for entry in reversed(entries):
        if not isinstance(entry, dict):
            continue
        if _int(entry.get("record_id")) <= after:
            break
        pg_id = _int(entry.get("pg_id"))
        if not entry.get("is_p2p") and pg_id not in newest:
            newest[pg_id] = _int(entry.get("collective_seq_id"))
        collective = _collective(entry)
        if collective is not None:
            out.append(collective)
    out.sort(key=lambda c: c.record_id)
    first = entries[0] if entries else None
    oldest = _int(first.get("record_id")) if isinstance(first, dict) else -1
    return out, newest, oldest


def parse_dump(raw: bytes | str, after: int = -1) -> list[Collective]:
    """The collectives of one dump (JSON or pickle), recorded after record id ``after``
    (point-to-point entries left out), oldest first."""
    return _scan(_entries(_load(raw)), after)[0]


def _group_status(raw: bytes | str) -> dict[int, tuple[int, int]] | None:
    """Each group's last enqueued and last completed sequence ids, from a dump's ``pg_status``
    (None where it has none: the ring is then read on the clock alone)."""
    status = _load(raw).get("pg_status")
    if not isinstance(status, dict) or not status:
        return None
    out = {}
    for pg_id, figures in status.items():
        if not isinstance(figures, dict):
            return None
        try:
            out[int(pg_id)] = (
                int(figures.get("last_enqueued_collective", -1)),
                int(figures.get("last_completed_collective", -1)),
            )
        except (TypeError, ValueError):
            return None
    return out


class CollectiveReader:
    """Reads the ring when it changed, at most once a second and no more than its share of the
    time, and hands back only what is new.

    An entry is new once its ``record_id`` passes the last one sent; an entry seen while it had
    no completion time yet is sent again once it has one (NCCL with timing fills it later).
    """

    def __init__(
        self,
        dump: Callable[[], bytes] | None = None,
        clock: Callable[[], float] = time.monotonic,
        status: Callable[[], bytes] | None = None,
        share: float = READ_SHARE,
        timer: Callable[[], float] = time.thread_time,
    ) -> None:
        """``dump``: the whole ring (JSON or pickle); ``status``: the dump without entries,
        which says whether the ring changed (None: read it on the clock alone); ``share``: the
        share of the time the reads may take (0: once a second, whatever they cost);
        ``timer``: what a read's cost is measured with."""
        if dump is None:
            recorders = _recorders()
            if recorders:
                dump, status = recorders[-1].read, recorders[-1].status
        self._dump = dump
        self._status = status
        self._clock = clock
        self._timer = timer
        self.share = share
        self._next_read = float("-inf")
        self._last_record = -1
        #: The groups' status at the last complete read (None: read regardless).
        self._seen_status: dict[int, tuple[int, int]] | None = None
        #: The newest sequence id read so far, per group id.
        self._newest: dict[int, int] = {}
        #: Groups whose last enqueued collective the last read did not find, and how many reads
        #: in a row found the same.
        self._missing: dict[int, tuple[int, int]] = {}
        self._retries = 0
        #: Each group's status last given up on (its collective was not found).
        self._given_up: dict[int, tuple[int, int]] = {}
        #: Entries sent before their completion was known (NCCL marks it later), by record id.
        self._pending: set[int] = set()
        self.failures = 0
        #: Whole-ring reads, their CPU time in all, the last one's, and the ring's length then.
        self.reads = 0
        self.read_s = 0.0
        self.last_read_s = 0.0
        self.ring = 0
        #: Reads left out because the groups' status had not moved since the last one.
        self.unchanged = 0
        #: Entries that left the ring before a read got to them.
        self.lost = 0

    @property
    def available(self) -> bool:
        return self._dump is not None

    @property
    def spacing_s(self) -> float:
        """The time the last read's cost puts before the next."""
        return min(MAX_SPACING_S, next_read_at(0.0, self.last_read_s, READ_INTERVAL, self.share))

    def _group_status_now(self) -> dict[int, tuple[int, int]] | None:
        if self._status is None:
            return None
        try:
            return _group_status(self._status())
        except Exception:
            return None

    def _up_to_date(
        self, status: dict[int, tuple[int, int]] | None
    ) -> dict[int, tuple[int, int]] | None:
        """``status`` once every group's last enqueued collective was read: the next read waits
        for it to move. gloo moves it before the entry is in the ring (a work queued behind
        another is recorded once gloo's thread takes it up), so a group still missing is read
        again, up to :data:`MAX_RETRIES` times with the same status (its entry may have left
        the ring)."""
        if status is None:
            return None
        missing = {
            pg: s
            for pg, s in status.items()
            if self._newest.get(pg, -1) < s[0] and self._given_up.get(pg) != s
        }
        if not missing:
            self._retries = 0
            return status
        self._retries = self._retries + 1 if missing == self._missing else 1
        self._missing = missing
        if self._retries < MAX_RETRIES:
            return None
        self._given_up.update(missing)
        return status

    def poll(self, final: bool = False) -> list[Collective]:
        """New collectives since the last poll; empty when read less than a second ago (or
        less than the last read's cost allows), or when nothing changed. ``final``: the job is
        ending, read now whatever the spacing (its last collectives, else never sent)."""
        if self._dump is None:
            return []
        now = self._clock()
        if now < self._next_read and not final:
            return []
        self._next_read = now + READ_INTERVAL
        status = self._group_status_now()
        if status is not None and status == self._seen_status:
            self.unchanged += 1
            return []
        started = self._timer()
        after = min(self._pending) - 1 if self._pending else self._last_record
        try:
            entries = _entries(_load(self._dump()))
            scanned, newest, oldest = _scan(entries, after)
        except Exception:  # no process group yet, or the ring is off: nothing to read
            self.failures += 1
            return []
        finally:
            self.last_read_s = self._timer() - started
            self.read_s += self.last_read_s
            self.reads += 1
            self._next_read = now + self.spacing_s
        self.ring = len(entries)
        if self._last_record >= 0 and oldest > self._last_record + 1:
            self.lost += oldest - self._last_record - 1
        for pg, seq in newest.items():
            self._newest[pg] = max(seq, self._newest.get(pg, -1))
        self._seen_status = self._up_to_date(status)
        fresh = [c for c in scanned if c.record_id > self._last_record]
        if fresh:
            self._last_record = fresh[-1].record_id
        completed = []
        if self._pending:
            in_ring = {c.record_id: c for c in scanned if c.record_id in self._pending}
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
    """The sampler's part: once this process has a process group, reads the recorder (when it
    changed, at most once a second and within ``share`` of the time) and returns one
    :class:`~torchtop.protocol.CollectivesSeen` with the new entries. Never imports torch first.
    Without a recorder it raises :class:`~torchtop.agent.probes.base.ProbeUnavailable` once,
    with the reason. Where the reads' cost spaces them beyond a second, or entries left the ring
    before a read, it says so once in a :class:`~torchtop.protocol.ProbeStatus`."""

    def __init__(self, reader: CollectiveReader | None = None, share: float = READ_SHARE) -> None:
        #: One reader per recorder (NCCL's and the generic one each number their entries).
        self._readers = [reader] if reader is not None else None
        #: The share of the time the reads may take, all recorders together.
        self.share = share
        self._told_spaced = False
        self._told_lost = False

    @property
    def readers(self) -> list[CollectiveReader]:
        return list(self._readers or ())

    def stats(self) -> dict[str, Any]:
        """What the reads cost: reads, their mean and last CPU time, the ring's length, the
        spacing the last read's cost set, the reads left out (nothing had changed) and the
        entries lost out of the ring."""
        readers = self.readers
        reads = sum(r.reads for r in readers)
        return {
            "reads": reads,
            "read_ms_mean": 1e3 * sum(r.read_s for r in readers) / reads if reads else None,
            "last_read_ms": max((1e3 * r.last_read_s for r in readers), default=None),
            "ring": max((r.ring for r in readers), default=0),
            "spacing_s": max((r.spacing_s for r in readers), default=READ_INTERVAL),
            "unchanged": sum(r.unchanged for r in readers),
            "lost": sum(r.lost for r in readers),
        }

    def tick(self, now: float, final: bool = False) -> list[CollectivesSeen | ProbeStatus]:
        """What is new in the rings. ``final``: the last read, at the job's end, whatever the
        spacing. Called from the sampler's thread alone: the dump takes torch's locks (NCCL's
        walks its communicators), and a hung job's dump must never hold up the job's exit,
        which waits for that thread a bounded time."""
        if self._readers is None:
            if not _group_ready():
                return []
            missing = recorder_missing() or _turned_off(os.environ)
            if missing is not None:
                raise ProbeUnavailable(missing)
            recorders = _recorders()
            share = self.share / len(recorders)
            self._readers = [
                CollectiveReader(r.read, status=r.status, share=share) for r in recorders
            ]
        fresh = [c for reader in self._readers for c in reader.poll(final)]
        told = self._tell()
        out: list[CollectivesSeen | ProbeStatus] = [told] if told is not None else []
        if not fresh:
            return out
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
        return out + [
            CollectivesSeen(t=now, entries=entries[i : i + FRAME_ENTRIES])
            for i in range(0, len(entries), FRAME_ENTRIES)
        ]

    def _tell(self) -> ProbeStatus | None:
        """The status line, the first time the reads are spaced beyond a second by their cost,
        and the first time entries left the ring before a read."""
        readers = self.readers
        slowest = max(readers, key=lambda r: r.spacing_s, default=None)
        if slowest is None:
            return None
        spaced = slowest.spacing_s > 1.5 * READ_INTERVAL
        lost = sum(r.lost for r in readers)
        if (not spaced or self._told_spaced) and (not lost or self._told_lost):
            return None
        self._told_spaced = self._told_spaced or spaced
        self._told_lost = self._told_lost or bool(lost)
        detail = (
            f"torch dumps the flight recorder's whole ring at each read ({slowest.ring} entries"
            f" in {1e3 * slowest.last_read_s:.1f} ms, holding the GIL): it is read"
            f" {slowest.spacing_s:.1f} s apart at least, within {self.share:.2%} of the time"
            " (a fifth of --cost-budget)"
        )
        if lost:
            detail += (
                f"; {lost} entries left the ring before a read (its size:"
                f" {BUFFER_ENV}, {os.environ.get(BUFFER_ENV, 'unset')})"
            )
        return ProbeStatus(t=time.time(), probe=PROBE, available=True, detail=detail)
