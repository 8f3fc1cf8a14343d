"""The real viewer in a real terminal (tmux), driven as a user drives it."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import SCRIPTS, tmux
from torchtop.transport import list_agents

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")


class Terminal:
    def __init__(self, session: str) -> None:
        self.session = session

    def screen(self) -> str:
        return tmux("capture-pane", "-p", "-J", "-t", self.session, check=False).stdout

    def keys(self, *keys: str) -> None:
        tmux("send-keys", "-t", self.session, *keys)

    def wait_for(self, predicate: Callable[[str], object], timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        screen = ""
        while time.monotonic() < deadline:
            screen = self.screen()
            if predicate(screen):
                return screen
            time.sleep(0.2)
        raise AssertionError(f"timed out; the screen shows:\n{screen}")


@contextlib.contextmanager
def tmux_terminal(columns: int, rows: int) -> Iterator[Terminal]:
    """A tmux session of that size running a plain bash, with this test's runtime directory,
    PATH, PYTHONPATH and HOME; killed after."""
    session = f"torchtop-test-{uuid.uuid4().hex[:8]}"
    env = " ".join(
        f"{k}={shlex.quote(v)}"
        for k, v in os.environ.items()
        if k in ("TORCHTOP_RUNTIME_DIR", "PATH", "PYTHONPATH", "HOME")
    )
    shell = f"env {env} TERM=xterm-256color PYTHONWARNINGS=ignore bash --norc --noprofile"
    tmux("new-session", "-d", "-s", session, "-x", str(columns), "-y", str(rows), shell)
    try:
        yield Terminal(session)
    finally:
        tmux("kill-session", "-t", session, check=False)


@pytest.fixture
def terminal() -> Iterator[Terminal]:
    with tmux_terminal(80, 24) as opened:
        yield opened


@pytest.fixture
def jobs_killed() -> Iterator[None]:
    """Whatever jobs a test leaves running are killed after it."""
    yield
    for agent in list_agents():
        with contextlib.suppress(OSError):
            os.kill(agent.pid, signal.SIGKILL)


def _stop_from_viewer(terminal: Terminal) -> None:
    """``q`` on a running job, then ``s``: stop it."""
    terminal.keys("q")
    terminal.wait_for(lambda s: "still running" in s)
    terminal.keys("s")


def test_live_viewer_shows_the_job_stays_open_and_quits(terminal: Terminal) -> None:
    script = SCRIPTS / "train_mlp.py"
    command = f"{sys.executable} -m torchtop run {script} --steps 60 --sleep 0.03; echo EXIT=$?"
    terminal.keys(command, "Enter")
    live = terminal.wait_for(lambda s: "running" in s and "heap" in s and "step 0 loss" in s)
    # The header names the job: its command, cut with an ellipsis where a deep checkout's
    # path does not fit beside the pid.
    shown = re.search(r"running  (.+?)…? +pid \d+", live)
    assert shown is not None and len(shown[1]) >= 24, live
    assert f"{script} --steps 60".startswith(shown[1]), live
    assert "RSS" in live and "Host" in live
    assert "m Snapshot" in _footer(live) and "p Profile" in _footer(live), live
    # The job's last output and its exit, together on screen (the log and the header may
    # redraw a frame apart).
    terminal.wait_for(
        lambda s: "ended · exit 0" in s and "step 50 loss" in s and "training done" in s
    )
    time.sleep(1.0)
    assert "ended · exit 0" in terminal.screen()  # still open after the job ended
    terminal.keys("q")
    assert "EXIT=0\n" in terminal.wait_for(lambda s: re.search(r"EXIT=\d+\n", s), timeout=15)


def test_quitting_a_running_job_asks_and_detach_leaves_it_running(
    terminal: Terminal, jobs_killed: None
) -> None:
    """Detached, the job writes to its log file: ``torchtop attach`` shows the file's recent
    lines in the log panel, says where the output goes, and follows it."""
    script = SCRIPTS / "train_mlp.py"
    command = f"{sys.executable} -m torchtop run {script} --steps 100000 --sleep 0.02; echo EXIT=$?"
    terminal.keys(command, "Enter")
    terminal.wait_for(lambda s: "running" in s and "step 0 loss" in s)
    terminal.keys("q")
    terminal.wait_for(lambda s: "still running" in s)
    terminal.keys("d")
    screen = terminal.wait_for(lambda s: re.search(r"EXIT=\d+\n", s), timeout=15)
    assert "EXIT=0\n" in screen and "left job pid" in screen
    (agent,) = list_agents()  # the job runs on
    terminal.keys("clear", "Enter")
    terminal.keys(f"{sys.executable} -m torchtop attach {agent.pid}", "Enter")
    terminal.wait_for(lambda s: "Log · " in s and "loss" in s)
    # The log alone, full height: at 80x24 the log panel's few rows scroll the line that
    # says where the output goes out of sight within a second or two.
    terminal.keys("l")
    screen = terminal.wait_for(
        lambda s: "output goes to " in s and f"{agent.pid}-job.log" in s and "loss" in s
    )
    shown = max(int(n) for n in re.findall(r"step (\d+) loss", screen))
    terminal.wait_for(lambda s: max(map(int, re.findall(r"step (\d+) loss", s)), default=0) > shown)
    terminal.keys("q")
    # Leaving the attached viewer says so, and where the output goes on.
    left = terminal.wait_for(lambda s: f"left job pid {agent.pid} running" in s, timeout=15)
    assert "tail -f " in left and f"{agent.pid}-job.log" in left, left


def test_the_live_run_exits_with_the_jobs_code(terminal: Terminal) -> None:
    script = SCRIPTS / "train_mlp.py"
    command = f"{sys.executable} -m torchtop run {script} --steps 5 --exit-code 3; echo EXIT=$?"
    terminal.keys(command, "Enter")
    # An ended job takes no snapshot or op window: its footer stops offering them (the footer
    # is redrawn a frame after the header).
    terminal.wait_for(
        lambda s: (
            "ended · exit 3" in s
            and "Advice" in _footer(s)
            and "Snapshot" not in _footer(s)
            and "Profile" not in _footer(s)
        ),
        timeout=15,
    )
    terminal.keys("q")
    assert "EXIT=3\n" in terminal.wait_for(lambda s: re.search(r"EXIT=\d+\n", s), timeout=15)


def test_a_job_stopped_from_the_viewer_exits_130(terminal: Terminal, jobs_killed: None) -> None:
    script = SCRIPTS / "train_mlp.py"
    command = f"{sys.executable} -m torchtop run {script} --steps 100000 --sleep 0.02; echo EXIT=$?"
    terminal.keys(command, "Enter")
    terminal.wait_for(lambda s: "running" in s and "step 0 loss" in s)
    _stop_from_viewer(terminal)
    screen = terminal.wait_for(lambda s: re.search(r"EXIT=\d+\n", s), timeout=30)
    assert "EXIT=130\n" in screen
    assert list_agents() == []


def test_an_input_bound_job_shows_its_finding_with_evidence_at_80_by_24(
    terminal: Terminal,
) -> None:
    """The header counts the finding; ``a`` opens the Advice panel with its evidence, its fix
    and its demo, readable in an 80x24 terminal."""
    script = SCRIPTS / "advice_jobs.py"
    command = f"{sys.executable} -m torchtop run {script} --case input-bound; echo EXIT=$?"
    terminal.keys(command, "Enter")
    # The header's summary: the data wait is about 40% of each step (critical) or just under.
    terminal.wait_for(lambda s: re.search(r"1 (critical|warning)", s), timeout=120)
    terminal.keys("a")
    panel = terminal.wait_for(lambda s: "Input-bound" in s and "see: torchtop demo" in s)
    assert re.search(r"evidence \(\d+ s-\d+ s\): data wait \d+% of step time", panel), panel
    assert "num_workers=0" in panel and "torchtop demo dataloader" in panel
    assert max(len(line) for line in panel.splitlines()) <= 80
    terminal.keys("Escape")
    terminal.wait_for(lambda s: "ended · exit 0" in s, timeout=120)
    terminal.keys("q")
    assert "EXIT=0\n" in terminal.wait_for(lambda s: re.search(r"EXIT=\d+\n", s), timeout=15)


def test_leaving_the_viewer_of_a_crashed_job_prints_its_exit_traceback_and_log(
    terminal: Terminal, tmp_path: object
) -> None:
    """After ``q`` the terminal keeps what happened: the exit, the job's last traceback, the
    log file and the recording, each with the command that reads it."""
    script = SCRIPTS / "train_mlp.py"
    record = f"{tmp_path}/boom.ttrec"
    command = (
        f"{sys.executable} -m torchtop run --record {record} {script} --steps 50 --raise-at 12;"
        " echo EXIT=$?"
    )
    terminal.keys(command, "Enter")
    terminal.wait_for(lambda s: "ended · exit 1" in s)
    terminal.keys("q")
    after = terminal.wait_for(lambda s: re.search(r"EXIT=\d+\n", s), timeout=15)
    assert "EXIT=1\n" in after
    assert re.search(r"job pid \d+ .*exited with code 1", after), after
    assert "Traceback (most recent call last):" in after
    assert "RuntimeError: boom at step 12" in after
    log = re.search(r"(/\S+/\d+-job\.log)", after)
    assert log is not None and os.path.exists(log[1]), after
    assert f"less {log[1]}" in after
    assert f"torchtop report {record}" in after


def _footer(screen: str) -> str:
    """The key hints: the screen's last line that has any."""
    return [line for line in screen.splitlines() if line.strip()][-1]


def test_a_replay_at_80_by_24_offers_the_keys_that_apply_and_no_gpu_takes_one_row(
    terminal: Terminal, tmp_path: object
) -> None:
    record = f"{tmp_path}/short.ttrec"
    script = SCRIPTS / "train_mlp.py"
    made = subprocess.run(
        [sys.executable, "-m", "torchtop", "run", "--headless", "--record", record, str(script)],
        capture_output=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    terminal.keys(f"{sys.executable} -m torchtop replay {record}; echo EXIT=$?", "Enter")
    screen = terminal.wait_for(lambda s: "ended · exit 0" in s and "Advice" in _footer(s))
    footer = _footer(screen)
    for key in ("q Quit", "? Help", "l Log", "space Pause", "e End", "+/- Speed", "a Advice"):
        assert key in footer, footer
    # A recording takes no snapshot or op window, and has no out-of-memory failure to show.
    assert "Snapshot" not in footer and "Profile" not in footer and "OOM" not in footer
    rows = screen.splitlines()
    if "no NVIDIA GPU" in screen:  # a machine without an NVIDIA driver: said in one row
        gpu = next(i for i, row in enumerate(rows) if "─ GPU" in row)
        assert "no NVIDIA GPU" in rows[gpu + 1]
        assert not rows[gpu + 2].split("│")[0].strip(), screen
    terminal.keys("q")
    terminal.wait_for(lambda s: "EXIT=0" in s, timeout=15)


def test_a_script_whose_processes_become_ranks_goes_on_in_the_same_viewer_on_its_run(
    terminal: Terminal,
) -> None:
    """``torchtop run`` of a script that starts its ranks with ``mp.spawn``: the job's screen
    gives way to the run's screen in the same viewer (the process and its terminal stay the
    same), which shows both ranks; ``q`` stops the job and exits with its code."""
    script = SCRIPTS / "ddp.py"
    command = (
        f"{sys.executable} -m torchtop run {script} --spawn 2 --steps 100000 --sleep-ms 5; "
        "echo EXIT=$?"
    )
    terminal.keys(command, "Enter")
    run = terminal.wait_for(
        lambda s: "rank" in s and "pid" in s and "trend" in s and s.count("running") >= 2,
        timeout=120,
    )
    assert "launcher pid" in run and "q stops the" in run, run
    terminal.keys("q")
    done = terminal.wait_for(lambda s: re.search(r"EXIT=\d+\n", s), timeout=60)
    assert re.search(r"EXIT=(130|0)\n", done), done


def test_a_stopped_job_gets_time_to_save_its_checkpoint(
    terminal: Terminal, jobs_killed: None
) -> None:
    """A job that saves a checkpoint on KeyboardInterrupt (8 s here) is not terminated under
    it: torchtop says it waits, and the job ends as it chose to (0), its checkpoint saved."""
    script = SCRIPTS / "slow_stop.py"
    command = f"{sys.executable} -m torchtop run {script} 8; echo EXIT=$?"
    terminal.keys(command, "Enter")
    terminal.wait_for(lambda s: "running" in s and "step 50" in s)
    _stop_from_viewer(terminal)
    terminal.wait_for(lambda s: "is still stopping" in s and "Ctrl-C terminates" in s)
    screen = terminal.wait_for(lambda s: re.search(r"EXIT=\d+\n", s), timeout=60)
    assert "EXIT=0\n" in screen, screen
    log = re.search(r"less (\S+-job\.log)", screen)
    assert log is not None, screen
    with open(log.group(1)) as file:
        assert "checkpoint saved" in file.read()


def test_ctrl_c_while_a_job_stops_terminates_it(terminal: Terminal, jobs_killed: None) -> None:
    script = SCRIPTS / "slow_stop.py"
    command = f"{sys.executable} -m torchtop run {script} 1 --ignore-sigint; echo EXIT=$?"
    terminal.keys(command, "Enter")
    terminal.wait_for(lambda s: "running" in s and "step 50" in s)
    _stop_from_viewer(terminal)
    terminal.wait_for(lambda s: "is still stopping" in s)
    terminal.keys("C-c")
    screen = terminal.wait_for(lambda s: re.search(r"EXIT=\d+\n", s), timeout=30)
    assert "terminating job pid" in screen and "EXIT=143\n" in screen, screen


def test_replay_against_a_second_recording_at_80_by_24(terminal: Terminal, tmp_path: Path) -> None:
    """Two real recordings of a small CPU job whose dataset is slow, with no DataLoader worker
    (A) and with four (B): ``replay A --against B`` shows ``torchtop compare``'s verdict beside
    the memory chart (the same words: on a loaded machine the difference may be noise) and
    B's lines on the step chart, all within 80x24."""
    from tests.processes.test_compare_run import compared, figure, finish, record

    none, four = tmp_path / "w0.ttr", tmp_path / "w4.ttr"
    jobs = [record(none, 0), record(four, 4)]
    for job in jobs:
        finish(job)
    report = compared(none, four)
    changed = report["changed"]
    verdict = f"changed: {changed[0]}" if changed else "no difference beyond noise"
    median = figure(report, "step_time_median_s")["verdict"]
    median = {"no difference beyond noise": "within noise"}.get(median, median)
    terminal.keys(
        f"{sys.executable} -m torchtop replay {none} --against {four}; echo EXIT=$?", "Enter"
    )
    terminal.wait_for(lambda s: "vs B · w4.ttr" in s)
    terminal.keys("e")
    screen = terminal.wait_for(lambda s: "ended · exit 0" in s and "step chart: B step" in s)
    rows = screen.splitlines()
    assert len(rows) <= 24 and all(len(row) <= 80 for row in rows), screen
    panel = [row.split("│")[-1].strip() for row in rows if "│" in row]
    assert any(row.startswith(verdict[:30]) for row in panel), (verdict, screen)
    assert any(re.match(rf"{median} +step time median [-+]", row) for row in panel), screen
    terminal.keys("q")
    terminal.wait_for(lambda s: "EXIT=0" in s, timeout=15)
