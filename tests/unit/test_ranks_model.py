"""The run-wide rules over the ranks' models (straggler, hang, dead rank), the backward timing
and the stuck-job stacks of the agent, fed with the messages the agents send."""

from __future__ import annotations

import dataclasses
import inspect
import threading
import time

from torchtop.agent import steps as step_hooks
from torchtop.agent.stall import StallWatch
from torchtop.agent.steps import StepCollector
from torchtop.model import JobModel
from torchtop.model.run import RunModel
from torchtop.model.run_advice import STRAGGLER_HOLD_S, job_frame, launcher_exits
from torchtop.protocol import (
    Hello,
    JobExited,
    LoaderInfo,
    LoaderStats,
    Sample,
    StackFrame,
    StackSampled,
    StepStats,
)

T0 = 1_000_000.0


def hello(rank: int, hang_after_s: float | None = None) -> Hello:
    return Hello(
        protocol=1, pid=100 + rank, argv=["train.py"], cwd="/", started_at=T0, python="3.11",
        torch="2.3", devices=[], interval_s=0.1, hostname="h", rank=rank, local_rank=rank,
        world_size=4, node_rank=0, run_id="run", restart_count=0, hang_after_s=hang_after_s,
    )  # fmt: skip


def steps(t: float, total: int, n: int, step: float, wait: float, backward: float) -> StepStats:
    """``n`` steps of ``step`` seconds each ending by ``t``, with that wait and backward."""
    return StepStats(
        t=t, total=total, skipped_total=0, count=n, skipped=0, timed=n, time_s=n * step,
        wait_s=n * wait, startup_s=0.0, optimizer_s=0.0, samples=0,
        ends=[t - (n - 1 - i) * step for i in range(n)], durations=[step] * n,
        waits=[wait] * n, backward_s=n * backward, backwards=[backward] * n,
    )  # fmt: skip


def sample(t: float) -> Sample:
    return Sample(t=t, host=None, memory=[])


def feed_run(per_rank: dict[int, tuple[float, float, float]], seconds: int = 8) -> RunModel:
    """Each rank's (step, wait, backward) for ``seconds`` of frames, 10 steps per frame."""
    run = RunModel(new_job=lambda: JobModel(mode="replay"))
    for rank in per_rank:
        run.apply(str(rank), hello(rank))
    for i in range(1, seconds * 2 + 1):
        t = T0 + i * 0.5
        for rank, (step, wait, backward) in per_rank.items():
            run.apply(str(rank), steps(t, i * 10, 10, step, wait, backward))
    return run


def test_the_rank_with_the_least_wait_in_backward_is_the_straggler_and_its_cause() -> None:
    # Rank 2 waits 30 ms more for data; the others wait the same 30 ms in the all-reduce.
    fast = (0.040, 0.001, 0.032)
    run = feed_run({0: fast, 1: fast, 2: (0.040, 0.031, 0.002), 3: fast})
    (finding,) = run.advisor.findings
    assert (finding.name, finding.rank, finding.severity) == ("straggler", 2, "critical")
    assert finding.evidence["score"] == round(0.030 / 0.040, 3)
    assert finding.evidence["cause"] == "data" and finding.evidence["coverage"]["data"] == 1.0
    # Named only once it has held.
    assert finding.last_t - finding.first_t <= 8 - STRAGGLER_HOLD_S


def test_extra_forward_time_is_attributed_to_compute() -> None:
    fast = (0.040, 0.001, 0.032)
    run = feed_run({0: fast, 1: (0.040, 0.001, 0.002), 2: fast})
    (finding,) = run.advisor.findings
    assert finding.rank == 1 and finding.evidence["cause"] == "compute"


def test_no_straggler_below_a_tenth_of_a_step_nor_in_a_balanced_run() -> None:
    assert feed_run({0: (0.040, 0.001, 0.010), 1: (0.040, 0.001, 0.0065)}).advisor.findings == []
    balanced = (0.040, 0.001, 0.005)
    assert feed_run({0: balanced, 1: balanced, 2: balanced}).advisor.findings == []


def test_no_straggler_without_backward_measured() -> None:
    # An older agent (no backward field): the rule abstains rather than call 0 a fast rank.
    assert feed_run({0: (0.040, 0.001, 0.0), 1: (0.040, 0.030, 0.0)}).advisor.findings == []


def stack(t: float, *where: tuple[str, int, str]) -> StackSampled:
    frames = [StackFrame(*w) for w in where]
    return StackSampled(t=t, stale_s=5.0, threshold_s=3.0, steps=10, thread="MainThread",
                        frames=frames)  # fmt: skip


MAIN = ("/job/train.py", 20, "<module>")
WAITS = ("/venv/lib/python3.11/site-packages/torch/autograd/__init__.py", 395, "backward")


def test_a_hang_names_the_rank_outside_any_collective_and_where_it_blocks() -> None:
    run = RunModel(new_job=lambda: JobModel(mode="replay"))
    for rank in range(3):
        run.apply(str(rank), hello(rank, hang_after_s=3.0))
        run.apply(str(rank), steps(T0 + 1, 10, 10, 0.01, 0.0, 0.005))
    assert run.advisor.findings == []
    for rank in range(3):
        run.apply(str(rank), sample(T0 + 3.5))
    # Stuck for 2.5 s: under the 3 s floor (10 median steps are only 0.1 s).
    assert run.advisor.findings == []
    blocking = ("/job/train.py", 57, "train_step")
    lock = ("/usr/lib/python3.11/threading.py", 629, "wait")
    run.apply("1", stack(T0 + 4.2, MAIN, blocking, lock))
    for rank in (0, 2):
        run.apply(str(rank), stack(T0 + 4.2, MAIN, ("/job/train.py", 60, "train_step"), WAITS))
    for rank in range(3):
        run.apply(str(rank), sample(T0 + 5.5))
    (finding,) = run.advisor.findings
    assert (finding.name, finding.rank) == ("hang", 1)
    assert finding.evidence["threshold_s"] == 3.0 and finding.evidence["stale_s"] == 4.5
    assert finding.evidence["outside_collective"] == [1]
    assert finding.evidence["in_collective"] == [0, 2]
    row = finding.evidence["ranks"][1]
    assert (row["file"], row["line"]) == ("/job/train.py", 57)  # the job's line, not the lock's
    assert "rank 1 at train.py:57 in train_step" in finding.summary
    # A step again: the hang clears.
    run.apply("0", steps(T0 + 6, 11, 1, 0.01, 0.0, 0.005))
    run.apply("0", sample(T0 + 7))
    assert run.advisor.findings == [] and run.advisor.cleared[-1].name == "hang"


def loaders(t: float, batches: int) -> LoaderInfo:
    stats = LoaderStats(index=1, name="loader 1", dataset="Val", batch_size=8, num_workers=0,
                        pin_memory=False, prefetch_factor=None, persistent_workers=False,
                        batches=batches)  # fmt: skip
    return LoaderInfo(t=t, loaders=[stats])


def test_an_evaluation_loop_taking_batches_without_steps_is_no_hang() -> None:
    run = RunModel(new_job=lambda: JobModel(mode="replay"))
    for rank in range(2):
        run.apply(str(rank), hello(rank, hang_after_s=3.0))
        run.apply(str(rank), steps(T0 + 1, 10, 10, 0.01, 0.0, 0.005))
    # Ten seconds of evaluation: batches, no step.
    for i in range(1, 11):
        for rank in range(2):
            run.apply(str(rank), loaders(T0 + 1 + i, 100 * i))
    assert run.advisor.findings == [] and not run.advisor.cleared
    # The batches stop too: now it is stuck.
    for rank in range(2):
        run.apply(str(rank), sample(T0 + 15))
    assert [f.name for f in run.advisor.findings] == ["hang"]


# torchrun's own failure summary, as it printed it for a rank killed with SIGKILL.
SUMMARY = """\
Failures:
[1]:
  time      : 2026-12-03_09:22:40
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 2338)  (SIGTERM)
  error_file: <N/A>
Root Cause (first observed failure):
[0]:
  time      : 2026-12-03_09:22:40
  host      : localhost
  rank      : 3 (local_rank: 3)
  exitcode  : -9 (pid: 2339)  (SIGKILL)
"""


def test_a_killed_rank_is_dead_with_the_launchers_exit_code() -> None:
    assert launcher_exits(SUMMARY.splitlines()) == {0: -15, 3: -9}
    run = RunModel(new_job=lambda: JobModel(mode="replay"))
    for rank in (0, 3):
        run.apply(str(rank), hello(rank))
        run.apply(str(rank), steps(T0 + 1, 5, 5, 0.01, 0.0, 0.005))
    lost = "connection lost: the job is gone without an exit status (killed?)"
    run.apply("3", JobExited(t=T0 + 2, exit_code=None, reason=lost))
    (finding,) = run.advisor.findings
    assert (finding.name, finding.rank, finding.severity) == ("rank_died", 3, "critical")
    assert "rank 0 still running" in finding.summary
    run.advisor.launcher_exits = launcher_exits(SUMMARY.splitlines())
    run.apply("0", JobExited(t=T0 + 3, exit_code=-15, reason="killed by SIGTERM"))
    found = {f.rank: f for f in run.advisor.findings}
    assert found[3].evidence["exit_code"] == -9 and "SIGKILL" in found[3].summary
    # Stopped by the launcher because rank 3 died: a consequence, not a second cause.
    assert found[0].severity == "info" and "after rank 3 died" in found[0].summary


def test_a_rank_dead_among_256_names_the_others_as_spans() -> None:
    """The line about one dead rank of 256 says which still run in a few spans, not 255 numbers."""
    run = RunModel(new_job=lambda: JobModel(mode="replay"))
    for rank in range(256):
        run.apply(str(rank), hello(rank))
    for rank in (0, 1, 3, 4, 5):
        run.apply(str(rank), steps(T0 + 1, 5, 5, 0.01, 0.0, 0.005))
    lost = "connection lost: the job is gone without an exit status (killed?)"
    run.apply("17", JobExited(t=T0 + 2, exit_code=None, reason=lost))
    (finding,) = run.advisor.findings
    assert finding.summary.endswith("ranks 0-16, 18-255 still running (a collective waits for it)")
    run.apply("2", JobExited(t=T0 + 3, exit_code=None, reason=lost))
    assert "ranks 0, 1, 3-16, 18-255 still running" in run.advisor.findings[0].summary


def test_backward_time_is_counted_once_per_step_even_when_nested() -> None:
    collector = StepCollector()

    def inner() -> None:
        time.sleep(0.01)

    wrapped_inner = step_hooks.wrap_backward(inner)

    def outer() -> None:
        wrapped_inner()  # reentrant checkpointing calls backward inside backward
        time.sleep(0.01)

    step_hooks.PENDING.clear()
    step_hooks.wrap_backward(outer)()
    events = list(step_hooks.PENDING)
    step_hooks.PENDING.clear()
    assert [e[0] for e in events] == [step_hooks.BACKWARD]
    collector.explicit_step(0.0)
    collector.backward(events[0][1], events[0][2])
    collector.explicit_step(1.0)
    frame = collector.frame(2.0, 0.0)
    assert frame is not None and 0.02 <= frame.backward_s < 0.5
    assert frame.backwards == [0.0, frame.backward_s]


def test_a_stuck_main_thread_s_stack_is_sent_from_another_thread() -> None:
    collector = StepCollector()
    collector.explicit_step(time.perf_counter())
    watch = StallWatch(hang_after_s=0.05)
    assert watch.check(collector, time.time()) is None  # not stale yet
    time.sleep(0.1)
    sent: list[StackSampled | None] = []

    def read() -> None:
        time.sleep(0.05)  # until the main thread is in join()
        sent.append(watch.check(collector, time.time()))

    reader = threading.Thread(target=read)
    reader.start()
    line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
    reader.join()  # the main thread blocks here while the agent's thread reads it
    (message,) = sent
    assert message is not None and message.stale_s >= 0.05
    # The innermost frame of the job's code (under it: threading's join, a library).
    ours = job_frame(message.frames)
    assert ours is not None and ours.file == __file__ and ours.line == line
    assert ours.function == "test_a_stuck_main_thread_s_stack_is_sent_from_another_thread"
    # Repeated only after REPEAT_S while the same stall lasts.
    assert watch.check(collector, time.time()) is None
    # A batch taken since the step (an evaluation loop) is progress: not stuck.
    collector.last_batch = time.perf_counter()
    assert StallWatch(hang_after_s=0.05).check(collector, time.time()) is None


def test_a_run_finding_is_exported_on_the_rank_it_names() -> None:
    from torchtop.export.figures import figures_of

    fast = (0.040, 0.001, 0.032)
    run = feed_run({0: fast, 1: fast, 2: (0.040, 0.031, 0.002)})
    findings = run.advisor.findings
    snaps = {rank: figures_of(run.jobs[str(rank)], findings) for rank in range(3)}
    assert snaps[2] is not None and ("straggler", "critical") in snaps[2].findings
    assert snaps[0] is not None and snaps[0].findings == ()


def test_a_job_that_becomes_a_rank_keeps_its_figures_under_its_new_identity() -> None:
    # Lightning's rank 0: the job's agent spoke as a single process, then its process group
    # said which rank it is (a fresh hello); the other rank spoke as one from the start.
    alone = dataclasses.replace(
        hello(0), rank=None, local_rank=None, world_size=None, node_rank=None, run_id=None
    )
    fast = (0.040, 0.001, 0.032)
    run = RunModel(new_job=lambda: JobModel(mode="replay"))
    run.apply("100", alone)
    run.apply("101", hello(1))
    for i in range(1, 17):
        t = T0 + i * 0.5
        if i == 3:
            run.apply("100", hello(0))
        for rank, stream in ((0, "100"), (1, "101")):
            step, wait, backward = (0.040, 0.031, 0.002) if rank == 0 else fast
            run.apply(stream, steps(t, i * 10, 10, step, wait, backward))
    job = run.jobs["100"]
    assert job.hello is not None and job.hello.rank == 0 and job.training.total == 160
    assert sorted(i.rank for i in run.by_identity() if i.rank is not None) == [0, 1]
    # The rules see it as the rank it became.
    (finding,) = run.advisor.findings
    assert (finding.name, finding.rank) == ("straggler", 0)
