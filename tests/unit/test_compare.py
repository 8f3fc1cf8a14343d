"""``torchtop compare`` on synthetic step samples: the same distribution twice is no difference,
a slower B is found with an interval that excludes 0, the warm-up is left out, and recordings
that cannot be compared say why in one line."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from torchtop.commands import main
from torchtop.model import JobModel
from torchtop.model.compare import (
    NOISE,
    CompareError,
    compare_jobs,
    compare_runs,
    detect_warmup,
    step_samples,
)
from torchtop.protocol import Hello, StepStats, encode
from torchtop.report.compare import Side, compare, render_text

T0 = 1_000_000.0


def hello(rank: int | None = None) -> Hello:
    return Hello(
        protocol=1, pid=100 + (rank or 0), argv=["train.py"], cwd="/", started_at=T0,
        python="3.11", torch="2.3", devices=[], interval_s=0.1, hostname="h", rank=rank,
        local_rank=rank, world_size=2 if rank is not None else None, node_rank=0,
        run_id="run" if rank is not None else None, restart_count=0,
    )  # fmt: skip


def job(
    durations: list[float], wait_share: float = 0.1, per_frame: int = 10, rank: int | None = None
) -> JobModel:
    """A job whose steps last ``durations`` (its first step untimed, as a job's first is),
    listed ``per_frame`` to a ``steps`` frame, each waiting ``wait_share`` of it for data."""
    model = JobModel(mode="replay")
    model.apply(hello(rank))
    model.apply_all(step_frames(durations, wait_share, per_frame))
    return model


def step_frames(
    durations: list[float], wait_share: float = 0.1, per_frame: int = 10, t0: float = T0
) -> list[StepStats]:
    """The ``steps`` frames of :func:`job`."""
    frames = []
    t = t0
    all_durations: list[float | None] = [None, *durations]
    total = 0
    for i in range(0, len(all_durations), per_frame):
        chunk = all_durations[i : i + per_frame]
        ends = []
        for d in chunk:
            t += d or 0.01
            ends.append(t)
        timed = [d for d in chunk if d is not None]
        total += len(chunk)
        frames.append(
            StepStats(
                t=t, total=total, skipped_total=0, count=len(chunk), skipped=0,
                timed=len(timed), time_s=sum(timed), wait_s=wait_share * sum(timed),
                startup_s=0.0, optimizer_s=0.0, samples=4 * len(timed), ends=ends,
                durations=chunk, waits=[wait_share * (d or 0.0) for d in chunk],
                batch_samples=[4] * len(chunk), backward_s=0.3 * sum(timed),
                backwards=[0.3 * (d or 0.0) for d in chunk],
            )
        )  # fmt: skip
    return frames


def noisy(n: int, median: float, seed: int) -> list[float]:
    """``n`` step times around ``median``, log-normal as real step times are (a long tail)."""
    rng = random.Random(seed)
    return [median * rng.lognormvariate(0.0, 0.15) for _ in range(n)]


def figure(changes: list, key: str):  # type: ignore[no-untyped-def]
    (change,) = [c for c in changes if c.key == key]
    return change


def test_the_same_distribution_twice_is_no_difference_beyond_noise() -> None:
    result = compare_jobs(job(noisy(300, 0.050, 1)), job(noisy(300, 0.050, 2)))
    median = figure(result.steps, "step_time_median_s")
    assert median.ci is not None and median.ci[0] <= 0 <= median.ci[1]
    assert not median.changed and median.verdict == NOISE
    assert result.changed == []


def test_a_20_percent_slower_b_is_found_with_an_interval_that_excludes_0() -> None:
    result = compare_jobs(job(noisy(300, 0.050, 1)), job(noisy(300, 0.060, 2)))
    median = figure(result.steps, "step_time_median_s")
    assert median.ci is not None and 0 < median.ci[0] <= median.delta <= median.ci[1]
    assert median.changed and median.verdict == "slower" and median.better is False
    assert median.relative == pytest.approx(0.2, abs=0.06)
    throughput = figure(result.steps, "steps_per_s")
    assert throughput.verdict == "lower" and throughput.better is False
    # The shares of step time did not move: no change said where there is none.
    assert not figure(result.steps, "data_wait_share").changed
    assert "step time median" in result.changed


def test_a_data_wait_share_that_drops_is_found() -> None:
    result = compare_jobs(job(noisy(200, 0.05, 1), 0.5), job(noisy(200, 0.05, 2), 0.05))
    wait = figure(result.steps, "data_wait_share")
    assert wait.changed and wait.verdict == "lower" and wait.better is True
    assert wait.delta == pytest.approx(-0.45, abs=1e-6)


def test_the_warm_up_is_detected_and_left_out_of_both_runs() -> None:
    warm = [0.5] * 12 + noisy(200, 0.05, 3)
    samples = step_samples(job(warm).training)
    assert samples[0].index == 1  # step 0, the job's first, has no duration
    assert detect_warmup(samples) == 13
    result = compare_jobs(job(warm), job(noisy(212, 0.05, 4)))
    assert result.alignment.start == 13 and not result.alignment.given
    assert not figure(result.steps, "steps_per_s").changed
    # Left in, the slow first steps weigh on the mean: throughput looks lower than it is.
    given = compare_jobs(job(warm), job(noisy(212, 0.05, 4)), skip=0)
    throughput = figure(given.steps, "steps_per_s")
    assert given.alignment.given and throughput.relative > 0.3


def test_runs_are_aligned_on_the_steps_both_took() -> None:
    result = compare_jobs(job(noisy(300, 0.05, 1)), job(noisy(100, 0.05, 2)), skip=10)
    a = result.alignment
    assert (a.start, a.end, a.steps_a, a.steps_b) == (10, 101, 301, 101)
    assert a.compared_a == a.compared_b == 91


def test_sampled_steps_keep_their_weight() -> None:
    # 200 steps listed as 20 frames of 5 points, each standing for 2 steps (agent sampling).
    model = JobModel(mode="replay")
    model.apply(hello())
    t, total = T0, 0
    for _ in range(20):
        ends = [t + 0.05 * (i + 1) * 2 for i in range(5)]
        t = ends[-1]
        total += 10
        model.apply(
            StepStats(
                t=t, total=total, skipped_total=0, count=10, skipped=0, timed=10, time_s=0.5,
                wait_s=0.0, startup_s=0.0, optimizer_s=0.0, samples=0, ends=ends,
                durations=[0.05] * 5,
            )
        )  # fmt: skip
    samples = step_samples(model.training)
    assert sum(s.weight for s in samples) == 200  # every point stands for 2 steps
    assert samples[-1].index + samples[-1].weight == model.training.total


def test_no_steps_and_a_skip_past_the_end_are_one_line_errors() -> None:
    empty = JobModel(mode="replay")
    empty.apply(hello())
    with pytest.raises(CompareError, match="recording A has no timed steps"):
        compare_jobs(empty, job(noisy(50, 0.05, 1)))
    with pytest.raises(CompareError, match="--skip-steps 500 leaves no step"):
        compare_jobs(job(noisy(50, 0.05, 1)), job(noisy(50, 0.05, 2)), skip=500)


def test_recordings_of_different_kinds_are_not_compared() -> None:
    one = Side("a.ttr", False, [job(noisy(50, 0.05, 1))])
    ranks = Side("b.ttr", True, [job(noisy(50, 0.05, r), rank=r) for r in (0, 1)])
    with pytest.raises(CompareError, match=r"cannot compare one process \(a.ttr\) with a run"):
        compare(one, ranks)


def test_multi_rank_runs_compare_rank_by_rank_and_as_a_run() -> None:
    before = [job(noisy(200, 0.05, 10 + r), rank=r) for r in (0, 1)]
    after = [job(noisy(200, 0.05 if r == 0 else 0.07, 20 + r), rank=r) for r in (0, 1)]
    result = compare_runs(before, after)
    assert [r.rank for r in result.ranks] == [0, 1]
    assert not figure(result.ranks[0].steps, "step_time_median_s").changed
    assert figure(result.ranks[1].steps, "step_time_median_s").verdict == "slower"
    assert result.alignment.compared_a == result.ranks[0].alignment.compared_a
    report = compare(Side("a", True, before), Side("b", True, after))
    assert "rank 1: step time median" in report["changed"]
    assert report["step_figures"][0]["key"] == "step_time_median_s"


def test_the_json_has_every_figure_and_the_text_renders_it() -> None:
    report = compare(
        Side("a.ttr", False, [job(noisy(100, 0.05, 1))]),
        Side("b.ttr", False, [job(noisy(100, 0.06, 2))]),
    )
    json.dumps(report)
    keys = [c["key"] for c in report["step_figures"]]
    assert keys[:5] == [
        "step_time_median_s",
        "step_time_p90_s",
        "steps_per_s",
        "samples_per_s",
        "data_wait_share",
    ]
    median = report["step_figures"][0]
    assert median["verdict"] == "slower" and median["ci"][0] > 0
    assert report["ops_note"] == "no op timings over whole steps in A and B"
    assert "bootstrap" in report["method"]
    from rich.console import Console

    console = Console(width=80, record=True)
    console.print(render_text(report))
    assert "changed beyond noise: step time median" in console.export_text()


def write_idle(path: Path) -> None:
    """A recording of a job that took no step: its hello alone."""
    path.write_bytes(encode(hello()))


def test_a_missing_or_unreadable_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["compare", str(tmp_path / "a.ttr"), str(tmp_path / "b.ttr")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("torchtop: no recording at") and "\n" not in err
    (tmp_path / "bad.ttr").write_text("not a recording\n")
    assert main(["compare", str(tmp_path / "bad.ttr"), str(tmp_path / "bad.ttr")]) == 1
    assert "is not a torchtop recording" in capsys.readouterr().err
    # A recording without a step: said so, in one line.
    write_idle(tmp_path / "idle.ttr")
    assert main(["compare", str(tmp_path / "idle.ttr"), str(tmp_path / "idle.ttr")]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "torchtop: recording A has no timed steps to compare"
