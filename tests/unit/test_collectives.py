"""The flight recorder's reader (on dumps recorded from a real 2-rank gloo job under torch 2.13:
``tests/fixtures/fr_trace_gloo_rank*.json``, three all-reduces on the default group with rank 1
sleeping 20 ms before each, one on a second group, one async) and the join of the ranks."""

from __future__ import annotations

import json
import pickle
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from torchtop.agent.collectives import (
    BUFFER_ENV,
    DEFAULT_RING,
    FINAL_WAIT_S,
    LEGACY_BUFFER_ENV,
    CollectiveMonitor,
    CollectiveReader,
    enable_recorder,
    parse_dump,
)
from torchtop.agent.rank_start import job_environment
from torchtop.agent.sampler import Sampler
from torchtop.model.collectives import (
    MIN_LATE_S,
    CollectiveRecord,
    hang_triage,
    join,
    lateness,
    lateness_of,
    straggler,
    waiting,
)
from torchtop.protocol import CollectiveEntry, CollectivesSeen, ProbeStatus, decode, encode

FIXTURES = Path(__file__).parents[1] / "fixtures"


def raw(rank: int) -> bytes:
    return (FIXTURES / f"fr_trace_gloo_rank{rank}.json").read_bytes()


def rings(name: str) -> dict[int, list[CollectiveEntry]]:
    """Each rank's ring from one of the recorded runs (``fr_rings_gloo_NAME.json``)."""
    data = json.loads((FIXTURES / f"fr_rings_gloo_{name}.json").read_text())
    return {
        int(rank): [CollectiveEntry(**{**e, "sizes": e["sizes"]}) for e in entries]
        for rank, entries in data["ranks"].items()
    }


def ring_records(
    name: str, shift_ms: dict[int, float] | None = None
) -> dict[int, list[CollectiveRecord]]:
    """The rings as the run model keeps them, each rank's enqueue times shifted by
    ``shift_ms``."""
    shift_ms = shift_ms or {}
    return {
        rank: [
            replace(rec, enqueued_ns=rec.enqueued_ns + int(shift_ms.get(rank, 0.0) * 1e6))
            for rec in map(CollectiveRecord.of, entries)
        ]
        for rank, entries in rings(name).items()
    }


def records(rank: int) -> list[CollectiveRecord]:
    out = [CollectiveRecord.from_wire(c.as_wire()) for c in parse_dump(raw(rank))]
    return [r for r in out if r is not None]


def test_a_real_gloo_dump_parses_into_collectives_per_group() -> None:
    got = parse_dump(raw(0))
    assert [(c.pg, c.seq, c.op) for c in got] == [
        ("0", 1, "all_reduce"),
        ("0", 2, "all_reduce"),
        ("0", 3, "all_reduce"),
        ("1", 1, "all_reduce"),
        ("0", 4, "all_reduce"),
    ]
    assert got[0].sizes == ((1000,),)
    # gloo records the enqueue only.
    assert all(c.enqueued_ns > 0 and c.started_ns == 0 == c.completed_ns for c in got)


def test_the_reader_sends_only_new_entries_and_reads_at_most_once_a_second() -> None:
    now = [0.0]
    dumps = [raw(0)]
    reader = CollectiveReader(dump=lambda: dumps[0], clock=lambda: now[0])
    assert len(reader.poll()) == 5
    now[0] = 0.5
    assert reader.poll() == []  # too soon
    now[0] = 2.0
    assert reader.poll() == []  # nothing new


def test_a_failing_dump_is_counted_not_raised() -> None:
    def broken() -> bytes:
        raise RuntimeError("no process group")

    reader = CollectiveReader(dump=broken, clock=lambda: 0.0)
    assert reader.poll() == [] and reader.failures == 1


def ring8(kind: str) -> bytes:
    """One real ring of 8 entries (a one-rank gloo job under torch 2.13: 3 all-reduces, one on a
    second group, an async one, a broadcast, then 6 more: the first 4 left the ring), dumped by
    ``_dump_fr_trace`` (``pickle``), ``_dump_fr_trace_json`` (``json``) and the latter without
    entries (``status``)."""
    name = {"pickle": "fr_ring8_gloo.pickle", "json": "fr_ring8_gloo.json"}.get(kind)
    return (FIXTURES / (name or "fr_ring8_gloo_status.json")).read_bytes()


def test_torchs_pickle_dump_parses_as_its_json_dump_and_only_what_is_after_a_record() -> None:
    pickled, as_json = parse_dump(ring8("pickle")), parse_dump(ring8("json"))
    assert pickled == as_json and [c.record_id for c in pickled] == list(range(4, 12))
    assert [(c.pg, c.seq, c.op) for c in pickled[:2]] == [
        ("0", 4, "all_reduce"),
        ("0", 5, "broadcast"),
    ]
    assert pickled[0].sizes == ((64,),) and all(c.enqueued_ns > 0 for c in pickled)
    assert [c.record_id for c in parse_dump(ring8("pickle"), after=9)] == [10, 11]
    # A pickle that names a class is refused, not run.
    with pytest.raises(pickle.UnpicklingError, match=r"names builtins\.print"):
        parse_dump(pickle.dumps({"entries": [print]}))


class Ring:
    """A recorder whose dumps are the real ring above, counted, each read taking ``cost_s`` on
    a fake timer; ``status`` is what its dump without entries says."""

    def __init__(self, cost_s: float = 0.0) -> None:
        self.now = 0.0
        self.timer = 0.0
        self.cost_s = cost_s
        self.reads = 0
        self.ring = ring8("pickle")
        self.status = json.loads(ring8("status"))

    def dump(self) -> bytes:
        self.reads += 1
        self.timer += self.cost_s
        return self.ring

    def reader(self, share: float = 0.002) -> CollectiveReader:
        return CollectiveReader(
            self.dump,
            clock=lambda: self.now,
            status=lambda: json.dumps(self.status).encode(),
            share=share,
            timer=lambda: self.timer,
        )


def test_the_ring_is_read_only_when_its_groups_status_moved() -> None:
    ring = Ring()
    reader = ring.reader()
    assert len(reader.poll()) == 8 and ring.reads == 1
    # The status says group 1 last enqueued its collective 1, which left this ring (record 3):
    # read again in case it is late (gloo's is, see below), then taken as read.
    for ring.now in (1.0, 2.0):
        assert reader.poll() == []
    assert ring.reads == 1 + 2
    for ring.now in (3.0, 4.0, 8.0):
        assert reader.poll() == []
    assert ring.reads == 3 and reader.unchanged == 3  # an idle ring costs no read
    # gloo moves the status before its entry is in the ring: read until it is found.
    ring.status["pg_status"]["0"]["last_enqueued_collective"] = "12"
    ring.now = 9.0
    assert reader.poll() == [] and ring.reads == 4
    data = json.loads(ring8("json"))
    twelfth = dict(data["entries"][-1], record_id=12, collective_seq_id=12)
    ring.ring = json.dumps(dict(data, entries=[*data["entries"][1:], twelfth])).encode()
    ring.now = 10.0
    assert [(c.seq, c.record_id) for c in reader.poll()] == [(12, 12)] and ring.reads == 5
    ring.now = 11.0
    assert reader.poll() == [] and ring.reads == 5


def test_reads_are_spaced_by_their_cost_and_the_status_line_says_so_once() -> None:
    ring = Ring(cost_s=0.010)  # 10 ms a read, within 0.2% of the time: 5 s apart
    reader = ring.reader(share=0.002)
    monitor = CollectiveMonitor(reader, share=0.002)
    first = monitor.tick(0.0)
    (told,) = [m for m in first if isinstance(m, ProbeStatus)]
    assert told.probe == "collectives" and told.available
    assert "whole ring at each read (8 entries in 10.0 ms" in told.detail
    assert "read 5.0 s apart at least, within 0.20% of the time" in told.detail
    assert monitor.stats()["spacing_s"] == pytest.approx(5.0)
    ring.status["pg_status"]["0"]["last_enqueued_collective"] = "12"  # always something new
    for ring.now in (1.0, 2.5, 4.9):
        assert monitor.tick(ring.now) == []
    assert ring.reads == 1
    ring.now = 5.0
    monitor.tick(5.0)
    assert ring.reads == 2
    # Without a budget (``--cost-budget 0``), once a second whatever a read costs.
    free = Ring(cost_s=0.010)
    unbounded = free.reader(share=0.0)
    unbounded.poll()
    assert unbounded.spacing_s == 1.0


def test_entries_that_left_the_ring_before_a_read_are_counted_and_said() -> None:
    data = json.loads(ring8("json"))
    ring = Ring()
    ring.ring = json.dumps(dict(data, entries=data["entries"][:2])).encode()  # records 4, 5
    monitor = CollectiveMonitor(ring.reader(), share=0.002)
    assert [m for m in monitor.tick(0.0) if isinstance(m, ProbeStatus)] == []
    # The next read finds records 8 to 11: 6 and 7 went by unread.
    ring.ring = json.dumps(dict(data, entries=data["entries"][4:])).encode()
    ring.status["pg_status"]["0"]["last_enqueued_collective"] = "12"
    ring.now = 1.0
    got = monitor.tick(1.0)
    seen = [e.seq for m in got if isinstance(m, CollectivesSeen) for e in m.entries]
    assert seen == [8, 9, 10, 11] and monitor.stats()["lost"] == 2
    (told,) = [m for m in got if isinstance(m, ProbeStatus)]
    assert "2 entries left the ring before a read" in told.detail


def test_the_recorder_is_turned_on_unless_the_user_set_a_size() -> None:
    env: dict[str, str] = {}
    assert enable_recorder(env) and env[BUFFER_ENV] == str(DEFAULT_RING)
    theirs = {BUFFER_ENV: "50"}
    assert not enable_recorder(theirs) and theirs == {BUFFER_ENV: "50"}
    legacy = {LEGACY_BUFFER_ENV: "50"}
    assert not enable_recorder(legacy) and BUFFER_ENV not in legacy


def test_the_rank_that_slept_before_each_all_reduce_arrives_late_but_five_are_too_few() -> None:
    per_rank = lateness({0: records(0), 1: records(1)})
    assert per_rank[1].joined == 5
    assert per_rank[1].last_at >= 3
    assert 0.015 < per_rank[1].median_s < 0.2
    # Five collectives do not name a straggler: a job's first ones are where ranks end their
    # start-up at different times.
    assert straggler(per_rank) is None


def test_ranks_on_other_nodes_are_not_compared_unless_clocks_agree() -> None:
    recs = {0: records(0), 1: records(1)}
    apart = lateness(recs, nodes={0: "a", 1: "b"})
    assert apart[1].joined == 0
    assert lateness(recs, nodes={0: "a", 1: "b"}, clocks_agree=True)[1].joined == 5


def test_a_balanced_run_of_alternating_arrivals_names_no_straggler() -> None:
    base = [CollectiveRecord("0", s, "all_reduce", (), 1_000_000_000 * s) for s in range(1, 11)]
    late = [
        CollectiveRecord(r.pg, r.seq, r.op, (), r.enqueued_ns + (s % 2) * 1000)
        for s, r in enumerate(base)
    ]
    assert straggler(lateness({0: base, 1: late})) is None


def test_hang_triage_names_who_never_entered_and_a_desync() -> None:
    def upto(n: int, last_op: str = "all_reduce") -> list[CollectiveRecord]:
        return [
            CollectiveRecord("0", s, "all_reduce" if s < n else last_op) for s in range(1, n + 1)
        ]

    found = hang_triage({0: upto(5), 1: upto(4), 2: upto(5)}, stacks={1: "train.py:88 in evaluate"})
    assert len(found) == 1
    f = found[0]
    assert (f.pg, f.seq, f.last_completed_seq, f.op) == ("0", 5, 4, "all_reduce")
    assert f.waiting == (0, 2) and f.missing == (1,)
    assert "rank 1 never entered: train.py:88 in evaluate" in f.line()
    desync = hang_triage({0: upto(5), 1: upto(5, "broadcast"), 2: upto(5)})
    assert desync[0].desync == ((1, "broadcast"),) and desync[0].missing == ()
    assert hang_triage({0: upto(5), 1: upto(5)}) == []


def test_the_monitor_sends_new_entries_in_one_frame_after_the_group_exists() -> None:
    reader = CollectiveReader(dump=lambda: raw(1), clock=lambda: 5.0)
    frames = CollectiveMonitor(reader).tick(12.0)
    assert len(frames) == 1 and frames[0].t == 12.0
    sent = decode(encode(frames[0]))
    assert isinstance(sent, CollectivesSeen)
    assert [(e.pg, e.seq) for e in sent.entries][:2] == [("0", 1), ("0", 2)]
    assert sent.entries[0].sizes == [[1000]] and sent.entries[0].enqueued_ns > 0
    # No process group in this process: nothing is read, and torch is not imported for it.
    assert CollectiveMonitor().tick(1.0) == []


def test_the_agents_last_tick_reads_the_collectives_of_the_jobs_last_second() -> None:
    # A short job's last all-reduces come within the second after a read: the agent's last
    # tick, as the job ends, reads them whatever the spacing, else they are never sent.
    data = json.loads(raw(0))
    dumps = [dict(data, entries=data["entries"][:2])]
    reader = CollectiveReader(dump=lambda: json.dumps(dumps[0]).encode(), clock=lambda: 5.0)
    monitor = CollectiveMonitor(reader)
    (first,) = monitor.tick(5.0)
    assert isinstance(first, CollectivesSeen) and len(first.entries) == 2
    dumps[0] = data
    assert monitor.tick(5.2) == []  # a sampler tick within the second reads nothing
    (last,) = monitor.tick(5.3, final=True)
    assert isinstance(last, CollectivesSeen)
    assert [(e.pg, e.seq) for e in last.entries] == [("0", 3), ("1", 1), ("0", 4)]
    assert monitor.tick(5.4, final=True) == []  # nothing twice


class _Nothing:
    """The host and CPU probes of a sampler that only reads collectives."""

    def read(self, *args: object) -> None:
        return None


def test_the_samplers_thread_makes_the_last_read_and_a_dump_that_hangs_never_holds_the_exit() -> (
    None
):
    data = json.loads(raw(0))
    dumps = [dict(data, entries=data["entries"][:2])]
    monitor = CollectiveMonitor(
        CollectiveReader(dump=lambda: json.dumps(dumps[0]).encode(), clock=time.monotonic)
    )
    sent: list[object] = []
    sampler = Sampler(
        sent.append, host=_Nothing(), cpu_memory=_Nothing(), cuda_memory=None, nvml=None,
        interval_s=0.05, collectives=monitor,
    )  # fmt: skip
    sampler._torch_seen = True
    sampler.start()
    deadline = time.monotonic() + 10
    while not any(isinstance(m, CollectivesSeen) for m in sent):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    dumps[0] = data  # the job's last all-reduces, within a second of the read before
    sampler.stop(timeout=FINAL_WAIT_S, final=True)
    seqs = [(e.pg, e.seq) for m in sent if isinstance(m, CollectivesSeen) for e in m.entries]
    assert seqs == [("0", 1), ("0", 2), ("0", 3), ("1", 1), ("0", 4)]
    # The last sample, from the thread ending the job, leaves the collectives to that read.
    sampler.tick(collectives=False)
    assert monitor.readers[0].reads == 2

    # A dump that hangs (a stuck NCCL communicator) holds up the sampler's thread, not the exit.
    release = threading.Event()
    stuck = Sampler(
        sent.append, host=_Nothing(), cpu_memory=_Nothing(), cuda_memory=None, nvml=None,
        interval_s=60, collectives=CollectiveMonitor(
            CollectiveReader(dump=lambda: (release.wait(30), raw(0))[1], clock=time.monotonic)
        ),
    )  # fmt: skip
    stuck._torch_seen = True
    stuck.start()
    time.sleep(0.2)  # its first tick's read is stuck
    began = time.monotonic()
    stuck.stop(timeout=0.3, final=True)
    assert time.monotonic() - began < 2.0
    release.set()


def test_a_launched_jobs_environment_turns_the_recorder_on_but_keeps_the_users_size() -> None:
    assert job_environment({}, {})[BUFFER_ENV] == str(DEFAULT_RING)
    assert job_environment({BUFFER_ENV: "300"}, {})[BUFFER_ENV] == "300"
    assert BUFFER_ENV not in job_environment({LEGACY_BUFFER_ENV: "300"}, {})


def test_the_run_model_names_the_late_rank_and_exports_its_lateness() -> None:
    from tests.unit.test_ranks_model import T0, hello
    from torchtop.export.families import families
    from torchtop.export.figures import figures_of
    from torchtop.model.job import JobModel
    from torchtop.model.run import RunModel

    run = RunModel(new_job=lambda: JobModel(mode="replay"))
    for rank, ring in rings("slow4").items():
        run.apply(str(rank), hello(rank))
        run.apply(str(rank), CollectivesSeen(t=T0 + 1, entries=ring))
    for now in (T0 + 1, T0 + 4):  # a straggler is shown once it held for a while
        run.advisor.evaluate(list(run), now)
    (finding,) = [f for f in run.advisor.findings if f.name == "straggler"]
    assert finding.rank == 2 and finding.evidence["source"] == "arrivals"
    assert "rank 2 arrives last at 98% of 125 collectives" in finding.summary
    # No step figures in this run: the cause is not told.
    assert finding.evidence["cause"] == "unknown"
    late = run.advisor.lateness[("run", 2)]
    snaps = [
        figures_of(run.jobs[str(r)], run.advisor.findings, run.advisor.lateness[("run", r)])
        for r in range(4)
    ]
    exported = {
        fam.name: {p.labels[1]: p.value for p in fam.points}
        for fam in families(s for s in snaps if s is not None)
    }
    points = exported["torchtop_collective_lateness_seconds"]
    assert points == {str(r): run.advisor.lateness[("run", r)].mean_s for r in range(4)}
    assert points["2"] > 0.020 > points["0"]
    # The waiting share: the three others wait most of their time for rank 2; it hardly does.
    waits = exported["torchtop_collective_wait_ratio"]
    assert waits["2"] == late.wait_share and waits["2"] < 0.05
    assert all(waits[str(r)] > 0.5 for r in (0, 1, 3))
    run_wait = run.advisor.waiting["run"]
    assert run_wait.waited_s == sum(run.advisor.lateness[("run", r)].waited_s for r in range(4))


def test_a_job_that_turned_the_recorder_off_is_told_once() -> None:
    from torchtop.agent.collectives import _turned_off

    assert _turned_off({BUFFER_ENV: "0"}) is not None and "TORCH_FR_BUFFER_SIZE=0" in str(
        _turned_off({BUFFER_ENV: "0"})
    )
    assert _turned_off({BUFFER_ENV: "300"}) is None and _turned_off({}) is None


def test_a_full_ring_goes_out_in_frames_below_the_protocols_limit() -> None:
    import json

    from torchtop.agent.collectives import FRAME_ENTRIES
    from torchtop.protocol import MAX_FRAME_BYTES

    data = json.loads(raw(0))
    entry = dict(data["entries"][0], input_sizes=[[10**9] * 50] * 50)
    data["entries"] = [dict(entry, record_id=i, collective_seq_id=i + 1) for i in range(2000)]
    reader = CollectiveReader(dump=lambda: json.dumps(data).encode(), clock=lambda: 0.0)
    frames = [f for f in CollectiveMonitor(reader).tick(1.0) if isinstance(f, CollectivesSeen)]
    assert [len(f.entries) for f in frames] == [FRAME_ENTRIES] * (2000 // FRAME_ENTRIES)
    assert all(len(encode(f)) < MAX_FRAME_BYTES for f in frames)


def test_the_rank_slow_inside_backward_in_a_real_4_rank_run_is_named_on_a_clear_margin() -> None:
    per_rank = lateness(ring_records("slow4"))
    found = straggler(per_rank)
    assert found is not None and found.rank == 2
    late = found.late
    assert late.joined == 125 and late.last_share >= 0.9
    # 30 ms inside its backward: it arrives about that long after the latest other rank, far
    # above how far apart the other three arrive anyway.
    assert 0.020 <= late.margin_s <= 0.040
    assert found.spread_s < 0.010 and late.margin_s > 3 * found.spread_s


@pytest.mark.parametrize("name", ["bal4", "bal2"])
def test_balanced_real_runs_name_none_even_where_one_rank_is_often_last(name: str) -> None:
    per_rank = lateness(ring_records(name))
    assert straggler(per_rank) is None
    if name == "bal2":
        # Beside two busy loops, rank 0 was last at 122 of 205 collectives: the share alone
        # is not evidence, and its margin is below a millisecond.
        assert per_rank[0].last_at == 122 and per_rank[0].margin_s < 0.001


@pytest.mark.parametrize(
    ("shift_ms", "named"),
    [(3.0, False), (12.0, True)],
)
def test_a_rank_consistently_late_is_named_only_beyond_the_floor_and_the_spread(
    shift_ms: float, named: bool
) -> None:
    # The real balanced 4-rank rings with rank 1 arriving later by a constant at every
    # collective: 3 ms is under the floor, 12 ms is well above it and the others' spread.
    assert shift_ms / 1000 < MIN_LATE_S or named
    found = straggler(lateness(ring_records("bal4", {1: shift_ms})))
    assert (found is not None and found.rank == 1) == named


@pytest.mark.parametrize(("jitter_ms", "named"), [(0.0, True), (12.0, False)])
def test_a_late_rank_is_not_named_when_the_others_spread_as_far(
    jitter_ms: float, named: bool
) -> None:
    # The real balanced 4-rank rings with rank 3 later by 20 ms at every collective; ranks 1
    # and 2 later by ``jitter_ms`` at every other one, in turn. Rank 3 is last nearly always
    # and 8 ms or more after the latest other rank (over the floor), but where the others
    # spread by 12 ms that margin is not three times their spread.
    recs = ring_records("bal4")
    noisy = {}
    for rank, items in recs.items():
        out = []
        for i, rec in enumerate(items):
            ms = {3: 20.0, 1: jitter_ms * (i % 2), 2: jitter_ms * (1 - i % 2)}.get(rank, 0.0)
            out.append(replace(rec, enqueued_ns=rec.enqueued_ns + int(ms * 1e6)))
        noisy[rank] = out
    per_rank = lateness(noisy)
    assert per_rank[3].last_share >= 0.9 and per_rank[3].margin_s >= 0.0075
    found = straggler(per_rank)
    assert (found is not None and found.rank == 3) == named


def test_the_loaded_balanced_run_that_once_named_a_straggler_names_none() -> None:
    from tests.unit.test_ranks_model import T0, hello
    from torchtop.model.job import JobModel
    from torchtop.model.run import RunModel

    data = json.loads((FIXTURES / "fr_frames_gloo_balanced_loaded.json").read_text())
    run = RunModel(new_job=lambda: JobModel(mode="replay"))
    for rank in range(4):
        run.apply(str(rank), hello(rank))
    start = data["frames"][0]["t"]
    old_rule: list[int] = []
    for frame in data["frames"]:
        t = T0 + frame["t"] - start
        entries = [CollectiveEntry(**e) for e in frame["entries"]]
        run.apply(str(frame["rank"]), CollectivesSeen(t=t, entries=entries))
        for now in (t, t + 1, t + 2, t + 3):
            run.advisor.evaluate(list(run), now)
            # The rule of before: last at 60% and 5 ms after the first rank at the median.
            old_rule.extend(
                late.rank
                for late in run.advisor.lateness.values()
                if late.joined and late.last_share >= 0.6 and late.median_s >= 0.005
            )
    assert old_rule  # the case is a hard one: the old rule named a rank here
    assert [f for f in run.advisor.all_findings if f.name == "straggler"] == []


def test_the_waiting_is_each_ranks_time_until_the_last_arrival() -> None:
    def at(ms: float, seq: int) -> CollectiveRecord:
        return CollectiveRecord("0", seq, "all_reduce", ((4,),), int((1000 * seq + ms) * 1e6))

    # Two collectives a second apart; ranks arrive 0, 10 and 30 ms after the first.
    recs = {r: [at(ms, 1), at(ms, 2)] for r, ms in {0: 0.0, 1: 10.0, 2: 30.0}.items()}
    joined = join(recs)
    assert [j.last_rank for j in joined] == [2, 2]
    assert joined[0].wait_s == pytest.approx(0.030 + 0.020)
    per_rank = lateness_of(joined)
    assert per_rank[0].waited_s == pytest.approx(0.060)
    assert per_rank[2].waited_s == 0.0
    assert per_rank[2].margin_s == pytest.approx(0.020)
    assert per_rank[0].margin_s == pytest.approx(-0.030)
    assert per_rank[0].span_s == pytest.approx(1.030)
    run = waiting(per_rank)
    assert run is not None and run.joined == 2
    assert run.waited_s == pytest.approx(0.100)
    assert run.share == pytest.approx(0.100 / (3 * 1.030))


@pytest.mark.parametrize(
    ("extra", "cause"),
    [
        ({"wait_s": 0.031}, "data"),
        ({"own_s": 0.031, "optimizer_s": 0.030}, "optimizer"),
        ({"own_s": 0.031}, "forward"),
        ({}, "backward"),
        ({"wait_s": 0.015, "own_s": 0.015}, "unattributed"),
    ],
)
def test_the_cause_of_an_arrivals_straggler_is_its_extra_time_since_its_last_collective(
    extra: dict[str, float], cause: str
) -> None:
    from torchtop.model.run_advice import RankTimes, arrival_cause, arrival_straggler

    # The real 4-rank run where rank 2 arrives ~31 ms after the others (median margin), with
    # each rank's mean step as the step timer measures it: 40 ms, 2 ms of data wait, 30 ms in
    # backward (the others wait there for rank 2), 2 ms in the optimizer.
    per_rank = lateness(ring_records("slow4"))
    found = straggler(per_rank)
    assert found is not None and found.rank == 2

    def times(rank: int) -> RankTimes:
        base = {"wait_s": 0.002, "own_s": 0.008, "optimizer_s": 0.002}
        if rank == 2:
            base = {k: v + extra.get(k, 0.0) for k, v in base.items()}
        return RankTimes(rank, 20, 0.040, base["wait_s"], 0.030, base["own_s"], base["optimizer_s"])

    told, _, coverage = arrival_cause(found, [times(r) for r in range(4)])
    assert told == cause
    if cause in ("data", "forward", "optimizer"):
        assert coverage[cause] >= 0.8
    verdict = arrival_straggler(per_rank, 1_000_000.0, [times(r) for r in range(4)])
    assert verdict is not None and verdict.check.evidence["cause"] == cause
    if cause == "backward":
        assert "the delay is inside its backward" in verdict.check.summary
    # Without the step figures the cause is not told.
    assert arrival_cause(found, [])[0] == "unknown"


def test_a_second_group_is_joined_over_its_own_ranks() -> None:
    recs = ring_records("bal4")
    start = max(ring[-1].enqueued_ns for ring in recs.values())
    for rank in (0, 1):
        recs[rank] = [
            *recs[rank],
            *(
                CollectiveRecord("1", s, "all_reduce", ((4,),), start + s * 10**6 * (1 + rank))
                for s in (1, 2)
            ),
        ]
    joined = [j for j in join(recs) if j.pg == "1"]
    assert [(j.seq, [r for r, _ in j.late_s], j.last_rank) for j in joined] == [
        (1, [0, 1], 1),
        (2, [0, 1], 1),
    ]
    assert joined[1].late_s[1][1] == pytest.approx(0.002)


def test_an_entry_sent_before_its_completion_is_sent_again_once_it_has_one() -> None:
    # The real dump as NCCL shows it mid-flight (not retired, no completion yet), then done.
    data = json.loads(raw(0))
    flight = dict(data, entries=[dict(e, retired=False) for e in data["entries"]])
    done = dict(
        data,
        entries=[
            dict(e, retired=True, time_discovered_started_ns=e["time_created_ns"] + 1000,
                 time_discovered_completed_ns=e["time_created_ns"] + 5000)
            for e in data["entries"][:3]
        ] + [dict(e, retired=False) for e in data["entries"][3:]],
    )  # fmt: skip
    now = [0.0]
    dumps = [flight]
    reader = CollectiveReader(dump=lambda: json.dumps(dumps[0]).encode(), clock=lambda: now[0])
    first = reader.poll()
    assert len(first) == 5 and all(c.completed_ns == 0 for c in first)
    dumps[0], now[0] = done, 2.0
    again = reader.poll()
    assert [c.seq for c in again] == [1, 2, 3]
    assert all(c.enqueued_ns < c.started_ns < c.completed_ns for c in again)
    now[0] = 4.0
    assert reader.poll() == []  # sent once more, not every time
    # Gloo retires its entries with no completion: none is kept waiting for one.
    gloo = CollectiveReader(dump=lambda: raw(0), clock=lambda: now[0])
    assert len(gloo.poll()) == 5 and gloo._pending == set()


def test_nccls_own_ring_is_read_beside_the_generic_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # CUDA builds keep NCCL's collectives in ProcessGroupNCCL's own recorder: the generic dump
    # holds none of them. Here NCCL's ring is the real gloo dump of rank 1 moved to group 7
    # (each recorder numbers its entries from 0), beside rank 0's generic one.
    from torch._C import _distributed_c10d as c10d

    import torchtop.agent.collectives as module

    data = json.loads(raw(1))
    nccl = dict(
        data,
        entries=[
            dict(e, process_group=["7", "nccl_pg"], profiling_name="nccl:all_reduce")
            for e in data["entries"]
        ],
    )
    # NCCL's as JSON only; the generic one pickled (what torch's pickle dump holds: the same
    # dicts), its JSON dump giving the groups' status.
    monkeypatch.setattr(
        c10d, "_dump_nccl_trace_json", lambda *_: json.dumps(nccl).encode(), raising=False
    )
    monkeypatch.delattr(c10d, "_dump_nccl_trace", raising=False)
    monkeypatch.setattr(c10d, "_dump_fr_trace", lambda *_: pickle.dumps(json.loads(raw(0))))
    monkeypatch.setattr(c10d, "_dump_fr_trace_json", lambda *_: raw(0))
    monkeypatch.setattr(module, "_group_ready", lambda: True)
    assert module.recorder_missing() is None
    frames = CollectiveMonitor().tick(1.0)
    got = sorted((e.pg, e.seq) for f in frames for e in f.entries)
    assert got == sorted(
        [("7", s) for s in (1, 2, 3, 4)]
        + [("7", 1)]
        + [("0", s) for s in (1, 2, 3, 4)]
        + [("1", 1)]
    )
    # Neither is there: no recorder, said in one line.
    monkeypatch.delattr(c10d, "_dump_nccl_trace_json")
    monkeypatch.delattr(c10d, "_dump_fr_trace_json")
    assert module.recorder_missing() is None  # the pickle dump alone is a recorder
    monkeypatch.delattr(c10d, "_dump_fr_trace")
    assert "no flight recorder" in str(module.recorder_missing())


def test_the_text_reports_ranks_table_says_each_ranks_wait_and_the_runs() -> None:
    import io

    from rich.console import Console

    from torchtop.report.run import ranks_parts

    row = {"rank": 0, "pid": 1, "steps": 120, "step_time_s": 0.0376, "wait_fraction": 0.0,
           "peak_allocated_bytes": None, "peak_rss_bytes": None, "exit_code": 0}  # fmt: skip
    report = {
        "ranks": [
            {**row, "collectives": {"wait_share": 0.8251}},
            {**row, "rank": 1, "collectives": None},
        ],
        "collectives": {"joined": 106, "waited_s": 10.202731, "wait_share": 0.6048},
    }
    out = io.StringIO()
    Console(file=out, width=120).print(*ranks_parts(report))
    text = out.getvalue()
    lines = [line for line in text.splitlines() if "│" in line]
    assert "83%" in lines[0] and "n/a" in lines[1]
    assert "106 joined; the ranks waited 10.20 s in all" in text and "(60.5% of their time)" in text


def test_the_join_kept_between_evaluations_equals_the_whole_join() -> None:
    from torchtop.model.collectives import JoinCache

    # The real 4-rank rings arriving a few at a time, rank 3's first ones late, and a second
    # group of ranks 0 and 1 whose rank 1 joins it only later: each step equals the whole join.
    recs = ring_records("slow4")
    start = max(ring[-1].enqueued_ns for ring in recs.values())
    for rank in (0, 1):
        recs[rank] += [
            CollectiveRecord("1", s, "all_reduce", ((4,),), start + s * 10**6 * (1 + rank))
            for s in (1, 2, 3)
        ]
    cache = JoinCache()
    seen: dict[int, list[CollectiveRecord]] = {rank: [] for rank in recs}
    for step in range(0, 140, 7):
        for rank, ring in recs.items():
            upto = step if rank != 3 else max(0, step - 30)
            seen[rank] = ring[: upto + (3 if rank == 0 else 0)]
        assert cache.update(seen) == join(seen), step
    seen = dict(recs)
    assert cache.update(seen) == join(seen)
    assert len([j for j in join(seen) if j.pg == "1"]) == 3
    # Other nodes: joined within each.
    nodes = {0: "a", 1: "a", 2: "b", 3: "b"}
    assert cache.update(seen, nodes) == join(seen, nodes)


def test_where_both_rules_name_the_same_rank_one_finding_carries_both() -> None:
    from tests.unit.test_ranks_model import T0, hello, steps
    from torchtop.model.job import JobModel
    from torchtop.model.run import RunModel

    # Rank 2 waits 30 ms more for data (the rule on the time outside backward names it) and
    # arrives last at the collectives of the real 4-rank rings.
    run = RunModel(new_job=lambda: JobModel(mode="replay"))
    for rank, ring in rings("slow4").items():
        run.apply(str(rank), hello(rank))
        run.apply(str(rank), CollectivesSeen(t=T0 + 0.1, entries=ring))
    fast, slow = (0.040, 0.001, 0.032), (0.040, 0.031, 0.002)
    for i in range(1, 17):
        for rank in range(4):
            step, wait, backward = slow if rank == 2 else fast
            run.apply(str(rank), steps(T0 + i * 0.5, 10 * i, 10, step, wait, backward))
    (finding,) = [f for f in run.advisor.findings if f.name == "straggler"]
    assert finding.rank == 2 and finding.evidence["cause"] == "data"
    assert finding.evidence["arrivals"]["source"] == "arrivals"
    assert finding.evidence["arrivals"]["cause"] == "data"
    assert "; it arrives last at 98% of 125 collectives" in finding.summary
