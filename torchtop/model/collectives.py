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
    "MIN_JOINED",
    "MIN_LATE_S",
    "SPREAD_MULTIPLE",
    "ArrivalStraggler",
    "CollectiveRecord",
    "HangFinding",
    "Joined",
    "Lateness",
    "RunWaiting",
    "hang_triage",
    "join",
    "lateness",
    "lateness_of",
    "straggler",
    "waiting",
]

#: The collectives kept per rank (about a minute of a DDP job's all-reduces).
MAX_KEPT = 4000
#: A rank is named a straggler only over at least this many joined collectives (a job's first
#: collectives, where the ranks end their start-up at different times, are not enough)...
MIN_JOINED = 20
#: ... when it is last at this share of them...
LATE_SHARE = 0.75
#: ... and, at the median, arrives at least this much after the latest of the other ranks
#: (seconds)...
MIN_LATE_S = 0.005
#: ... and at least this multiple of the other ranks' own spread (the upper quartile of their
#: lateness: how far apart balanced ranks arrive on this machine anyway).
SPREAD_MULTIPLE = 3.0
#: The quantile of the other ranks' lateness taken as their spread.
SPREAD_QUANTILE = 0.75


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


@dataclass(frozen=True)
class Joined:
    """One collective that every rank of a clock domain entered: when each arrived."""

    pg: str
    seq: int
    op: str
    sizes: tuple[tuple[int, ...], ...]
    #: The first rank's enqueue time (that domain's wall clock, ns).
    first_ns: int
    #: Each rank's lateness after the first arrival (seconds), by rank.
    late_s: tuple[tuple[int, float], ...]
    #: The rank the others waited for (the latest enqueue; the lowest rank on a tie), its
    #: lateness, and the latest of the others' (0 with a single rank).
    last_rank: int = -1
    last_s: float = 0.0
    second_s: float = 0.0

    @classmethod
    def of(
        cls,
        pg: str,
        seq: int,
        op: str,
        sizes: tuple[tuple[int, ...], ...],
        first_ns: int,
        late_s: tuple[tuple[int, float], ...],
    ) -> Joined:
        last_rank, last, second = -1, float("-inf"), 0.0
        for rank, late in late_s:  # by rank: a tie keeps the lowest
            if late > last:
                if last_rank >= 0:
                    second = last
                last_rank, last = rank, late
            elif late > second or last_rank < 0:
                second = late
        return cls(pg, seq, op, sizes, first_ns, late_s, last_rank, max(last, 0.0), second)

    @property
    def wait_s(self) -> float:
        """The time the ranks spent waiting for the last one here, summed over the ranks."""
        last = self.last_s
        return sum(last - late for _, late in self.late_s)


@dataclass
class Lateness:
    """One rank's arrivals over the joined collectives."""

    rank: int
    joined: int = 0
    last_at: int = 0
    mean_s: float = 0.0
    median_s: float = 0.0
    #: At the median, how long after the latest of the other ranks it arrived (negative: it
    #: was not last, and waited that long for the one that was).
    margin_s: float = 0.0
    #: The time it waited for the last rank, summed over the collectives.
    waited_s: float = 0.0
    #: From the first arrival at its first joined collective to the last at its last.
    span_s: float = 0.0
    samples: list[float] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)

    @property
    def last_share(self) -> float:
        return self.last_at / self.joined if self.joined else 0.0

    @property
    def wait_share(self) -> float | None:
        """The share of its time spent waiting for the last rank at collectives."""
        return self.waited_s / self.span_s if self.span_s > 0 else None


def _by_key(
    records: Mapping[int, Sequence[CollectiveRecord]],
) -> dict[tuple[str, int], dict[int, CollectiveRecord]]:
    joined: dict[tuple[str, int], dict[int, CollectiveRecord]] = {}
    for rank, items in records.items():
        for rec in items:
            joined.setdefault((rec.pg, rec.seq), {})[rank] = rec
    return joined


def join(
    records: Mapping[int, Sequence[CollectiveRecord]],
    nodes: Mapping[int, str] | None = None,
    clocks_agree: bool = False,
) -> list[Joined]:
    """The collectives all the group's ranks of a clock domain (a node, or the whole run when
    ``clocks_agree``) recorded, oldest first; a desync (ranks in different ops at one sequence
    id) is no arrival question and is left out. A group's members are the ranks that recorded
    any of its collectives (a second group of ranks 0 and 1 is joined over those two)."""
    nodes = nodes or {}
    domain_of = {rank: "" if clocks_agree else nodes.get(rank, "") for rank in records}
    members: dict[tuple[str, str], set[int]] = {}
    for rank, items in records.items():
        domain = domain_of[rank]
        for pg in {rec.pg for rec in items}:
            members.setdefault((pg, domain), set()).add(rank)
    out: list[Joined] = []
    for (pg, seq), by_rank in _by_key(records).items():
        domains: dict[str, list[int]] = {}
        for rank in by_rank:
            domains.setdefault(domain_of[rank], []).append(rank)
        for domain, ranks in domains.items():
            if len(ranks) < 2 or len(ranks) != len(members[(pg, domain)]):
                continue
            item = _join_one(pg, seq, {rank: by_rank[rank] for rank in ranks})
            if item is not None:
                out.append(item)
    out.sort(key=_oldest_first)
    return out


def _oldest_first(item: Joined) -> tuple[int, str, int]:
    return (item.first_ns, item.pg, item.seq)


def _join_one(pg: str, seq: int, by_rank: Mapping[int, CollectiveRecord]) -> Joined | None:
    """One collective as every member of its group in one clock domain recorded it; None for
    a desync (ranks in different ops at that sequence id: no arrival question)."""
    ranks = sorted(by_rank)
    recs = [by_rank[rank] for rank in ranks]
    op = recs[0].op
    if any(rec.op != op for rec in recs):
        return None
    first = min(rec.enqueued_ns for rec in recs)
    late = tuple(
        (rank, (rec.enqueued_ns - first) / 1e9) for rank, rec in zip(ranks, recs, strict=True)
    )
    return Joined.of(pg, seq, op, recs[0].sizes, first, late)


_Key = tuple[str, int, str]


class JoinCache:
    """The join of one run kept from one evaluation to the next, so that each evaluation
    joins only the collectives that arrived since (joining every rank's 4000 kept collectives
    every second cost more than the run's other rules). It gives what :func:`join` gives on
    the same records; a group that gains a member after some of its collectives were joined,
    or a rank whose node changes, is joined again from the start."""

    def __init__(self) -> None:
        #: Each rank's newest record taken in (by identity: the job model keeps them).
        self._last: dict[int, CollectiveRecord] = {}
        self._domain_of: dict[int, str] = {}
        self._members: dict[tuple[str, str], set[int]] = {}
        #: Collectives not every member of their group recorded yet.
        self._pending: dict[tuple[str, int], dict[int, CollectiveRecord]] = {}
        #: Every collective joined (None: a desync), and the joined ones oldest first.
        self._done: dict[_Key, Joined | None] = {}
        self._order: list[tuple[_Key, Joined]] = []

    def _reset(self) -> None:
        self._last.clear()
        self._members.clear()
        self._pending.clear()
        self._done.clear()
        self._order = []

    def update(
        self,
        records: Mapping[int, Sequence[CollectiveRecord]],
        nodes: Mapping[int, str] | None = None,
        clocks_agree: bool = False,
    ) -> list[Joined]:
        """The joined collectives of ``records`` (each rank's, oldest first), oldest first."""
        nodes = nodes or {}
        domain_of = {rank: "" if clocks_agree else nodes.get(rank, "") for rank in records}
        if domain_of != self._domain_of:
            self._reset()
            self._domain_of = domain_of
        fresh = {rank: self._fresh(rank, items) for rank, items in records.items()}
        joined_groups = {key[0] for key in self._done}
        for rank, items in fresh.items():
            for pg in {rec.pg for rec in items}:
                group = self._members.setdefault((pg, domain_of[rank]), set())
                if rank not in group:
                    group.add(rank)
                    if pg in joined_groups:  # joined over fewer ranks than it has
                        self._reset()
                        return self.update(records, nodes, clocks_agree)
        touched: dict[tuple[str, int], None] = {}
        for rank, items in fresh.items():
            domain = domain_of[rank]
            for rec in items:
                if (rec.pg, rec.seq, domain) in self._done:
                    continue  # sent again (NCCL added its completion): its arrival is known
                self._pending.setdefault((rec.pg, rec.seq), {})[rank] = rec
                touched[(rec.pg, rec.seq)] = None
        added: list[tuple[_Key, Joined]] = []
        for pg, seq in touched:
            by_rank = self._pending[(pg, seq)]
            domains: dict[str, list[int]] = {}
            for rank in by_rank:
                domains.setdefault(domain_of[rank], []).append(rank)
            for domain, ranks in domains.items():
                if len(ranks) < 2 or len(ranks) != len(self._members[(pg, domain)]):
                    continue
                item = _join_one(pg, seq, {rank: by_rank.pop(rank) for rank in ranks})
                self._done[(pg, seq, domain)] = item
                if item is not None:
                    added.append(((pg, seq, domain), item))
            if not by_rank:
                del self._pending[(pg, seq)]
        if added:
            added.sort(key=lambda pair: _oldest_first(pair[1]))
            in_order = not self._order or _oldest_first(added[0][1]) >= _oldest_first(
                self._order[-1][1]
            )
            self._order.extend(added)
            if not in_order:
                self._order.sort(key=lambda pair: _oldest_first(pair[1]))
        self._bound()
        return [item for _, item in self._order]

    def _fresh(self, rank: int, items: Sequence[CollectiveRecord]) -> list[CollectiveRecord]:
        """The rank's records since the last update (all of them if its newest then is gone)."""
        last = self._last.get(rank)
        out: list[CollectiveRecord] = []
        for rec in reversed(items):
            if rec is last:
                break
            out.append(rec)
        if out:
            self._last[rank] = out[0]
        out.reverse()
        return out

    def _bound(self) -> None:
        """At most :data:`MAX_KEPT` collectives a group joined, and as many waiting."""
        groups = max(1, len({pg for pg, _ in self._members}))
        limit = MAX_KEPT * groups
        if len(self._done) > limit:
            for key in list(self._done)[: len(self._done) - limit]:
                del self._done[key]
            self._order = [pair for pair in self._order if pair[0] in self._done]
        if len(self._pending) > limit:
            for key2 in list(self._pending)[: len(self._pending) - limit]:
                del self._pending[key2]


def lateness_of(joined: Sequence[Joined]) -> dict[int, Lateness]:
    """Per rank: its arrivals over the joined collectives."""
    out: dict[int, Lateness] = {}
    spans: dict[int, list[int]] = {}
    for item in joined:
        last_rank, last, second = item.last_rank, item.last_s, item.second_s
        first_ns = item.first_ns
        end_ns = first_ns + int(last * 1e9)
        for rank, late_s in item.late_s:
            late = out.get(rank)
            if late is None:
                late = out[rank] = Lateness(rank)
                spans[rank] = [first_ns, end_ns]
            late.joined += 1
            late.samples.append(late_s)
            if rank == last_rank:
                late.last_at += 1
                late.margins.append(late_s - second)
            else:
                late.margins.append(late_s - last)
                late.waited_s += last - late_s
            span = spans[rank]
            if first_ns < span[0]:
                span[0] = first_ns
            if end_ns > span[1]:
                span[1] = end_ns
    for rank, late in out.items():
        late.mean_s = statistics.fmean(late.samples)
        late.median_s = statistics.median(late.samples)
        late.margin_s = statistics.median(late.margins)
        begin, end = spans[rank]
        late.span_s = (end - begin) / 1e9
    return out


def lateness(
    records: Mapping[int, Sequence[CollectiveRecord]],
    nodes: Mapping[int, str] | None = None,
    clocks_agree: bool = False,
) -> dict[int, Lateness]:
    """Per rank: its lateness against the first arrival at every collective all ranks of its
    clock domain (its node, or the whole run when ``clocks_agree``) recorded."""
    out = {rank: Lateness(rank) for rank in records}
    out.update(lateness_of(join(records, nodes, clocks_agree)))
    return out


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


@dataclass(frozen=True)
class ArrivalStraggler:
    """The rank the others wait for, and the margin that decided it."""

    late: Lateness
    #: The upper quartile of the other ranks' lateness: how far apart they arrive anyway.
    spread_s: float

    @property
    def rank(self) -> int:
        return self.late.rank


def straggler(per_rank: Mapping[int, Lateness]) -> ArrivalStraggler | None:
    """The rank last at most collectives, named only on a margin clearly above the ranks'
    spread: over :data:`MIN_JOINED` collectives or more, last at :data:`LATE_SHARE` of them,
    and at the median later than the latest other rank by :data:`MIN_LATE_S` and by
    :data:`SPREAD_MULTIPLE` times the other ranks' spread. A false alarm costs more than a
    miss: a balanced run under load (ranks descheduled in turn) must name none."""
    candidates = [late for late in per_rank.values() if late.joined]
    if len(candidates) < 2:
        return None
    worst = max(candidates, key=lambda late: (late.last_share, late.margin_s))
    if worst.joined < MIN_JOINED or worst.last_share < LATE_SHARE:
        return None
    others = [s for late in candidates if late is not worst for s in late.samples]
    spread = _quantile(others, SPREAD_QUANTILE)
    if worst.margin_s < MIN_LATE_S or worst.margin_s < SPREAD_MULTIPLE * spread:
        return None
    return ArrivalStraggler(worst, spread)


@dataclass(frozen=True)
class RunWaiting:
    """The time the ranks spent waiting for the last one at the collectives."""

    joined: int
    #: Summed over ranks and collectives (rank-seconds).
    waited_s: float
    #: That time over the ranks' time between their first and last joined collective.
    share: float | None

    def json(self) -> dict[str, object]:
        return {
            "joined": self.joined,
            "waited_s": round(self.waited_s, 6),
            "wait_share": round(self.share, 4) if self.share is not None else None,
        }


def waiting(per_rank: Mapping[int, Lateness]) -> RunWaiting | None:
    """The run's waiting for the last rank; None where no collective was joined."""
    joined = [late for late in per_rank.values() if late.joined]
    if not joined:
        return None
    waited = sum(late.waited_s for late in joined)
    span = sum(late.span_s for late in joined)
    return RunWaiting(
        max(late.joined for late in joined), waited, waited / span if span > 0 else None
    )


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
