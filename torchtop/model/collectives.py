"""The ranks' collectives joined on (process group, sequence id): who arrives late, and where a
hang stopped.

Each rank sends the collectives its flight recorder saw (:mod:`torchtop.agent.collectives`):
process group, sequence id, op, sizes and the enqueue time (gloo records no start or
completion). The same (pg, seq) on every rank is the same collective; a rank's **lateness** at
it is its enqueue time minus the first rank's, and the rank with the latest enqueue is **last**
there (the one the others wait for).

Clocks: enqueue times are each node's wall clock, so lateness is computed only among the ranks
of one node (they share a clock); ranks on other nodes are compared only when the caller says
their clocks agree (``clocks_agree``). Completion times would be the common reference, but gloo
records none.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torchtop.protocol import CollectiveEntry

__all__ = [
    "LATE_SHARE",
    "MAX_KEPT",
    "MIN_LATE_S",
    "CollectiveRecord",
    "HangFinding",
    "Lateness",
    "hang_triage",
    "lateness",
    "straggler",
]

#: The collectives kept per rank (about a minute of a DDP job's all-reduces).
MAX_KEPT = 4000
#: A rank is named a straggler when it is last at this share of the joined collectives...
LATE_SHARE = 0.6
#: ... and arrives at least this much later than the first rank at the median (seconds).
MIN_LATE_S = 0.005


@dataclass(frozen=True)
class CollectiveRecord:
    pg: str
    seq: int
    op: str
    sizes: tuple[tuple[int, ...], ...] = ()
    enqueued_ns: int = 0

    @classmethod
    def of(cls, entry: CollectiveEntry) -> CollectiveRecord:
        sizes = tuple(tuple(d for d in shape if isinstance(d, int)) for shape in entry.sizes)
        return cls(entry.pg, entry.seq, entry.op, sizes, entry.enqueued_ns)

    @classmethod
    def from_wire(cls, raw: Mapping[str, object]) -> CollectiveRecord | None:
        pg, seq, op = raw.get("pg"), raw.get("seq"), raw.get("op")
        enq = raw.get("enqueued_ns")
        if not (isinstance(pg, str) and isinstance(seq, int) and isinstance(op, str)):
            return None
        sizes_raw = raw.get("sizes")
        sizes: tuple[tuple[int, ...], ...] = ()
        if isinstance(sizes_raw, list):
            sizes = tuple(
                tuple(d for d in s if isinstance(d, int)) for s in sizes_raw if isinstance(s, list)
            )
        return cls(pg, seq, op, sizes, enq if isinstance(enq, int) else 0)


@dataclass
class Lateness:
    """One rank's arrivals over the joined collectives."""

    rank: int
    joined: int = 0
    last_at: int = 0
    mean_s: float = 0.0
    median_s: float = 0.0
    samples: list[float] = field(default_factory=list)

    @property
    def last_share(self) -> float:
        return self.last_at / self.joined if self.joined else 0.0


def _by_key(
    records: Mapping[int, Sequence[CollectiveRecord]],
) -> dict[tuple[str, int], dict[int, CollectiveRecord]]:
    joined: dict[tuple[str, int], dict[int, CollectiveRecord]] = {}
    for rank, items in records.items():
        for rec in items:
            joined.setdefault((rec.pg, rec.seq), {})[rank] = rec
    return joined


def lateness(
    records: Mapping[int, Sequence[CollectiveRecord]],
    nodes: Mapping[int, str] | None = None,
    clocks_agree: bool = False,
) -> dict[int, Lateness]:
    """Per rank: its lateness against the first arrival at every collective all ranks of its
    clock domain (its node, or the whole run when ``clocks_agree``) recorded."""
    nodes = nodes or {}
    out = {rank: Lateness(rank) for rank in records}
    for by_rank in _by_key(records).values():
        domains: dict[str, dict[int, CollectiveRecord]] = {}
        for rank, rec in by_rank.items():
            domain = "" if clocks_agree else nodes.get(rank, "")
            domains.setdefault(domain, {})[rank] = rec
        for domain, members in domains.items():
            everyone = [r for r in records if clocks_agree or nodes.get(r, "") == domain]
            if len(members) < 2 or len(members) != len(everyone):
                continue
            if len({rec.op for rec in members.values()}) != 1:
                continue  # a desync: not an arrival question
            first = min(rec.enqueued_ns for rec in members.values())
            last_rank = max(members, key=lambda r: members[r].enqueued_ns)
            for rank, rec in members.items():
                late = out[rank]
                late.joined += 1
                late.samples.append((rec.enqueued_ns - first) / 1e9)
                if rank == last_rank:
                    late.last_at += 1
    for late in out.values():
        if late.samples:
            late.mean_s = statistics.fmean(late.samples)
            late.median_s = statistics.median(late.samples)
    return out


def straggler(per_rank: Mapping[int, Lateness]) -> Lateness | None:
    """The rank last at most collectives, when it is last at most of them and clearly late."""
    candidates = [late for late in per_rank.values() if late.joined]
    if len(candidates) < 2:
        return None
    worst = max(candidates, key=lambda late: (late.last_share, late.median_s))
    if worst.last_share >= LATE_SHARE and worst.median_s >= MIN_LATE_S:
        return worst
    return None


@dataclass(frozen=True)
class HangFinding:
    """Where one process group stopped."""

    pg: str
    last_completed_seq: int
    seq: int
    op: str
    sizes: tuple[tuple[int, ...], ...]
    waiting: tuple[int, ...]
    missing: tuple[int, ...]
    desync: tuple[tuple[int, str], ...] = ()
    stacks: tuple[tuple[int, str], ...] = ()

    def line(self) -> str:
        ranks = ",".join(str(r) for r in self.waiting)
        text = f"pg {self.pg} seq {self.seq} {self.op}: ranks {ranks} waiting"
        for rank in self.missing:
            stack = dict(self.stacks).get(rank)
            text += f"; rank {rank} never entered" + (f": {stack}" if stack else "")
        for rank, op in self.desync:
            text += f"; rank {rank} is in {op} at that seq (desync)"
        return text


def hang_triage(
    records: Mapping[int, Sequence[CollectiveRecord]],
    stacks: Mapping[int, str] | None = None,
    members: Mapping[str, Sequence[int]] | None = None,
) -> list[HangFinding]:
    """Per process group: the last sequence id every member reached, and who entered the next.

    Gloo records no completion, so a collective counts as done by all once every member has
    entered a later one; the members of a group are those that recorded it (or ``members``).
    """
    stacks = stacks or {}
    by_pg: dict[str, dict[int, dict[int, CollectiveRecord]]] = {}
    for rank, items in records.items():
        for rec in items:
            by_pg.setdefault(rec.pg, {}).setdefault(rank, {})[rec.seq] = rec
    findings: list[HangFinding] = []
    for pg, per_rank in sorted(by_pg.items()):
        ranks = sorted(members.get(pg, per_rank) if members else per_rank)
        highest = {r: max(per_rank.get(r, {0: None})) for r in ranks}
        top = max(highest.values())
        low = min(highest.values())
        seq = low + 1
        if top == low:
            ops = {per_rank[r][top].op for r in ranks if top in per_rank.get(r, {})}
            if len(ops) <= 1:
                continue
            seq = top  # every rank entered it, in different collectives: a desync
        entered = {r: per_rank[r][seq] for r in ranks if seq in per_rank.get(r, {})}
        if not entered:
            continue
        majority = statistics.mode(rec.op for rec in entered.values())
        example = next(rec for rec in entered.values() if rec.op == majority)
        findings.append(
            HangFinding(
                pg=pg,
                last_completed_seq=seq - 1,
                seq=seq,
                op=majority,
                sizes=example.sizes,
                waiting=tuple(r for r in ranks if r in entered and entered[r].op == majority),
                missing=tuple(r for r in ranks if r not in entered),
                desync=tuple(
                    (r, entered[r].op) for r in ranks if r in entered and entered[r].op != majority
                ),
                stacks=tuple((r, stacks[r]) for r in ranks if r not in entered and r in stacks),
            )
        )
    return findings
