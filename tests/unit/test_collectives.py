"""The flight recorder's reader (on dumps recorded from a real 2-rank gloo job under torch 2.13:
``tests/fixtures/fr_trace_gloo_rank*.json``, three all-reduces on the default group with rank 1
sleeping 20 ms before each, one on a second group, one async) and the join of the ranks."""

from __future__ import annotations

from pathlib import Path

from torchtop.agent.collectives import (
    BUFFER_ENV,
    DEFAULT_RING,
    LEGACY_BUFFER_ENV,
    CollectiveMonitor,
    CollectiveReader,
    enable_recorder,
    parse_dump,
)
from torchtop.agent.rank_start import job_environment
from torchtop.model.collectives import CollectiveRecord, hang_triage, lateness, straggler
from torchtop.protocol import CollectivesSeen, decode, encode

FIXTURES = Path(__file__).parents[1] / "fixtures"


def raw(rank: int) -> bytes:
    return (FIXTURES / f"fr_trace_gloo_rank{rank}.json").read_bytes()


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


def test_the_recorder_is_turned_on_unless_the_user_set_a_size() -> None:
    env: dict[str, str] = {}
    assert enable_recorder(env) and env[BUFFER_ENV] == str(DEFAULT_RING)
    theirs = {BUFFER_ENV: "50"}
    assert not enable_recorder(theirs) and theirs == {BUFFER_ENV: "50"}
    legacy = {LEGACY_BUFFER_ENV: "50"}
    assert not enable_recorder(legacy) and BUFFER_ENV not in legacy


def test_the_rank_that_slept_before_each_all_reduce_is_named_late() -> None:
    per_rank = lateness({0: records(0), 1: records(1)})
    assert per_rank[1].joined == 5
    assert per_rank[1].last_at >= 3
    found = straggler(per_rank)
    assert found is not None and found.rank == 1
    assert 0.015 < found.median_s < 0.2


def test_ranks_on_other_nodes_are_not_compared_unless_clocks_agree() -> None:
    recs = {0: records(0), 1: records(1)}
    apart = lateness(recs, nodes={0: "a", 1: "b"})
    assert apart[1].joined == 0
    assert lateness(recs, nodes={0: "a", 1: "b"}, clocks_agree=True)[1].joined == 5


def test_a_balanced_run_names_no_straggler() -> None:
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
    for rank in (0, 1):
        run.apply(str(rank), hello(rank))
        frame = CollectiveMonitor(CollectiveReader(dump=lambda r=rank: raw(r))).tick(T0 + 1)
        run.apply(str(rank), frame[0])
    for now in (T0 + 1, T0 + 4):  # a straggler is shown once it held for a while
        run.advisor.evaluate(list(run), now)
    (finding,) = [f for f in run.advisor.findings if f.name == "straggler"]
    assert finding.rank == 1 and finding.evidence["source"] == "arrivals"
    assert "rank 1 arrives last at" in finding.summary
    late = run.advisor.lateness[("run", 1)]
    snaps = [
        figures_of(run.jobs[str(r)], run.advisor.findings, run.advisor.lateness[("run", r)])
        for r in (0, 1)
    ]
    points = {
        p.labels[1]: p.value
        for fam in families(s for s in snaps if s is not None)
        if fam.name == "torchtop_collective_lateness_seconds"
        for p in fam.points
    }
    assert points == {"0": run.advisor.lateness[("run", 0)].mean_s, "1": late.mean_s}
    assert points["1"] > 0.010 > points["0"]


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
    frames = CollectiveMonitor(reader).tick(1.0)
    assert [len(f.entries) for f in frames] == [FRAME_ENTRIES] * (2000 // FRAME_ENTRIES)
    assert all(len(encode(f)) < MAX_FRAME_BYTES for f in frames)
