"""A multi-rank job's output and step times as the run's view shows them: each rank's lines
behind its rank's prefix, from one source each, and a strip of step times per rank on one
scale (the tmux tests in tests/viewer/test_ranks_view.py drive them in a terminal)."""

from __future__ import annotations

from tests.unit.test_ranks_model import T0, feed_run, hello
from torchtop.agent.rank_site.torchtop_rank_marks import WHOLE_LINES_ENV, unbuffered, whole_lines
from torchtop.agent.rank_start import rank_environment
from torchtop.job_output import RANK_PREFIX_TEMPLATE, split_rank
from torchtop.protocol import LogLine
from torchtop.streams.runner import RankRun
from torchtop.streams.runs import RunFold
from torchtop.tui.screens.run import STDERR_STYLE, log_line, rank_style, render_rank_strips
from torchtop.tui.widgets.chart import ChartSeries


def test_the_launcher_tees_each_ranks_output_behind_its_global_rank() -> None:
    env = rank_environment({"PATH": "/bin"}, {}, ["torchrun", "--nproc_per_node=2", "t.py"])
    assert env["PET_TEE"] == "3"
    assert env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == RANK_PREFIX_TEMPLATE == "[rank${rank}]:"
    assert env[WHOLE_LINES_ENV] == "1"  # torchrun copies each rank's file a line at a time


def test_the_users_own_tee_redirects_or_prefix_stand() -> None:
    for args in (["--tee", "1"], ["--redirects=3"], ["-r", "3"], ["-t1"]):
        env = rank_environment({}, {}, ["torchrun", *args, "t.py", "-r"])
        assert "PET_TEE" not in env, args
        assert WHOLE_LINES_ENV not in env, args
    env = rank_environment({"PET_REDIRECTS": "3"}, {}, ["torchrun", "t.py"])
    assert "PET_TEE" not in env
    # The script's own arguments are not the launcher's.
    env = rank_environment({}, {}, ["torchrun", "t.py", "--tee", "0"])
    assert env["PET_TEE"] == "3"
    env = rank_environment({"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "<${rank}>"}, {}, [])
    assert env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == "<${rank}>"


class _Stream:
    def __init__(self) -> None:
        self.calls: list[dict[str, bool]] = []

    def reconfigure(self, **options: bool) -> None:
        self.calls.append(options)


def test_the_job_writes_whole_lines_only_where_torchtop_chose_its_buffering() -> None:
    env: dict[str, str] = {}
    unbuffered(env)
    assert env == {"PYTHONUNBUFFERED": "1", WHOLE_LINES_ENV: "1"}
    stream = _Stream()
    whole_lines(env, (stream, object()))  # a stream that cannot be reconfigured is left be
    assert stream.calls == [{"line_buffering": True, "write_through": False}]
    # The user's own choice stands: unbuffered means each piece at once.
    env = {"PYTHONUNBUFFERED": "1"}
    unbuffered(env)
    assert env == {"PYTHONUNBUFFERED": "1"}
    stream = _Stream()
    whole_lines(env, (stream,))
    assert stream.calls == []


def test_a_line_is_a_ranks_by_its_prefix_and_the_launchers_without() -> None:
    assert split_rank("[rank12]:loss 0.5") == (12, "loss 0.5")
    assert split_rank("[rank1]:[rank1]:[W] warning") == (1, "[rank1]:[W] warning")
    assert split_rank("Setting OMP_NUM_THREADS") == (None, "Setting OMP_NUM_THREADS")
    assert split_rank("  [rank1]: not at the start") == (None, "  [rank1]: not at the start")


def test_a_ranks_prefix_takes_its_colour_and_stderr_stays_red() -> None:
    line = log_line("stderr", "[rank2]:Traceback")
    assert line.plain == "[rank2]:Traceback"
    assert [(line.plain[s.start : s.end], s.style) for s in line.spans] == [
        ("[rank2]:", rank_style(2)),
        ("Traceback", STDERR_STYLE),
    ]
    assert log_line("stderr", "torchrun failed").style == STDERR_STYLE
    line = log_line("stdout", "[rank0]:ok")
    assert [(line.plain[s.start : s.end], s.style) for s in line.spans] == [
        ("[rank0]:", rank_style(0))
    ]


def _rank_line(stream: str, rank: int, text: str) -> LogLine:
    return LogLine(t=T0 + 1, stream=stream, text=text)


def test_an_attached_runs_lines_come_from_each_ranks_agent_with_its_prefix() -> None:
    run = RunFold()
    for rank in (0, 1):
        run.queue(str(100 + rank), hello(rank))
        run.queue(str(100 + rank), _rank_line("stdout", rank, f"epoch 1 on {rank}"))
    run.queue(None, LogLine(t=T0 + 2, stream="stderr", text="launcher says"))
    run.drain()
    assert [(e.stream, e.text) for e in run.launcher.logs] == [
        ("stdout", "[rank0]:epoch 1 on 0"),
        ("stdout", "[rank1]:epoch 1 on 1"),
        ("stderr", "launcher says"),
    ]


def test_a_launched_runs_lines_come_from_the_launcher_only() -> None:
    # The launcher's output already carries every rank's line: a rank's agent that captured
    # its output too would show each line twice.
    run = RankRun.__new__(RankRun)
    RunFold.__init__(run)
    run.queue("100", hello(0))
    run.queue("100", _rank_line("stdout", 0, "epoch 1"))
    run.queue(None, LogLine(t=T0 + 2, stream="stdout", text="[rank0]:epoch 1"))
    run.drain()
    assert [e.text for e in run.launcher.logs] == ["[rank0]:epoch 1"]


def _heights(strip: list[str]) -> list[int]:
    """Each column's height in braille dots, over a strip's lines (top first)."""
    heights = [0] * max(map(len, strip))
    for line in strip:
        for x, ch in enumerate(line):
            bits = ord(ch) - 0x2800 if "\u2800" <= ch <= "\u28ff" else 0
            heights[x] += max(
                sum(bool(bits & b) for b in (0x01, 0x02, 0x04, 0x40)),
                sum(bool(bits & b) for b in (0x08, 0x10, 0x20, 0x80)),
            )
    return heights


def test_each_rank_has_a_strip_on_one_scale_and_the_slower_stands_higher() -> None:
    points = [(T0 + i, 0.010) for i in range(60)]
    slow = [(T0 + i, 0.040) for i in range(60)]
    series = [
        (rank, ChartSeries(f"rank {rank}", slow if rank == 2 else points, rank_style(rank), True))
        for rank in range(4)
    ]
    text = render_rank_strips(series, width=60, rows=2, t_start=T0, t_end=T0 + 60, y_max=0.05)
    lines = text.plain.split("\n")
    assert len(lines) == 4 * 2 + 1
    assert [lines[2 * r].split("┤")[0].strip() for r in range(4)] == ["r0", "r1", "r2", "r3"]
    tops = [max(_heights([line[6:] for line in lines[2 * r : 2 * r + 2]])) for r in range(4)]
    # 8 dots a strip for 50 ms: 10 ms is 2 dots, 40 ms is 6.
    assert tops == [2, 2, 6, 2]
    assert lines[-1].startswith(" -60s└") and lines[-1].endswith("now") and "-30s" in lines[-1]


def test_the_chart_of_a_run_draws_each_ranks_time_outside_backward() -> None:
    from torchtop.tui.screens.run import outside_backward

    # Rank 2 arrives last at the all-reduce: its whole step is everyone's, its backward the
    # shortest.
    run = feed_run({0: (0.05, 0.0, 0.04), 1: (0.05, 0.0, 0.04), 2: (0.05, 0.03, 0.01)})
    times = {
        int(s): [round(v or 0.0, 6) for _, v in outside_backward(job, T0)]
        for s, job in run.jobs.items()
    }
    assert set(times[0]) == set(times[1]) == {0.01}
    assert set(times[2]) == {0.04}


def test_a_ranks_screen_shows_that_ranks_lines_from_the_launchers_output() -> None:
    """Opened from the run's view, a rank's screen gets its lines, those already folded and
    those that come while it is open, without their prefix and without the other ranks'."""
    from torchtop.streams.runner import RunSpec
    from torchtop.streams.sources import RankLines

    run = RankRun(RunSpec(target=["torchrun", "train.py"]))

    def line(t: float, text: str, stream: str = "stdout") -> None:
        run.queue(None, LogLine(t=t, stream=stream, text=text))

    line(1.0, "[rank0]:rank 0 says 0")
    line(2.0, "[rank1]:rank 1 says 0")
    line(3.0, "launcher: starting", "stderr")
    run.drain()
    line(4.0, "[rank1]:rank 1 warns 0", "stderr")  # queued, not yet folded
    got: list[LogLine] = []
    lines = RankLines(run, rank=1)
    lines.start(got.append)
    line(5.0, "[rank1]:rank 1 says 1")
    line(6.0, "[rank2]:rank 2 says 1")
    lines.close()
    line(7.0, "[rank1]:after the screen closed")
    shown = [(m.stream, m.text) for m in got if m.stream != "torchtop"]
    assert shown == [
        ("stdout", "rank 1 says 0"),
        ("stderr", "rank 1 warns 0"),
        ("stdout", "rank 1 says 1"),
    ]
