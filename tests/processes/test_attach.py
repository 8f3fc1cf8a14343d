"""``torchtop attach PID`` on jobs started with plain ``python``: an agent is started in them
with gdb (Python 3.10-3.13), and every refusal says what to do. Real processes, real gdb."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import SCRIPTS, kill_tree, torchtop
from tests.viewer.test_tui_tmux import Terminal, terminal  # noqa: F401 - the tmux fixture
from torchtop.attach import inject
from torchtop.protocol import OpsWindow, ProbeStatus, Sample, StepStats
from torchtop.streams.recording import read_recording
from torchtop.transport import list_agents

PLAIN_TRAIN = SCRIPTS / "plain_train.py"
EXPECTED_STDOUT = "first step done\ntraining done\n"
ATTACH = [sys.executable, "-m", "torchtop", "attach"]
HEADLESS_1S = ["--headless", "--duration", "1"]
AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def _gdb_can_attach() -> str | None:
    """Why gdb cannot start an agent on this machine, or ``None`` when it can: torchtop's own
    check (a function called in a throwaway process)."""
    if sys.version_info >= inject.REMOTE_EXEC_PYTHON:
        return None
    return inject.probe_gdb_call()


NO_ATTACH = _gdb_can_attach()
needs_attach = pytest.mark.skipif(NO_ATTACH is not None, reason=str(NO_ATTACH))


class Job:
    """A plain training job (no torchtop) started by the test and stopped by its stop file."""

    def __init__(self, tmp: Path, *args: str, python: str = sys.executable) -> None:
        self.stop_file = tmp / "stop"
        self.proc = subprocess.Popen(
            # It trains until the test stops it, however long a busy machine makes the test.
            [
                python,
                str(PLAIN_TRAIN),
                "--stop-file",
                str(self.stop_file),
                "--seconds",
                "900",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        assert self.proc.stdout is not None
        self.first_line = self.proc.stdout.readline()  # the job is training

    @property
    def pid(self) -> int:
        return self.proc.pid

    def finish(self) -> tuple[int, str, str]:
        self.stop_file.touch()
        out, err = self.proc.communicate(timeout=120)
        return self.proc.returncode, self.first_line + out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc)  # its DataLoader workers too: they hold its pipes
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.communicate(timeout=30)


@pytest.fixture
def jobs() -> Iterator[list[Job]]:
    started: list[Job] = []
    yield started
    for job in started:
        job.kill()


def _recorded(path: Path) -> dict[str, list[object]]:
    kinds: dict[str, list[object]] = {"steps": [], "samples": [], "ops": [], "attach": []}
    for message in read_recording(path).messages:
        if isinstance(message, StepStats):
            kinds["steps"].append(message)
        elif isinstance(message, Sample):
            kinds["samples"].append(message)
        elif isinstance(message, OpsWindow):
            kinds["ops"].append(message)
        elif isinstance(message, ProbeStatus) and message.probe == "attach":
            kinds["attach"].append(message)
    return kinds


def _attach_and_check(job: Job, tmp: Path) -> dict[str, list[object]]:
    record = tmp / "r.ttr"
    result = torchtop(
        "attach", str(job.pid), "--headless", "--record", str(record), "--duration", "5"
    )
    assert result.returncode == 0, result.stderr
    recorded = _recorded(record)
    steps = [s for s in recorded["steps"] if isinstance(s, StepStats)]
    assert sum(s.count for s in steps) > 0
    assert sum(s.timed for s in steps) > 0 and all(s.time_s >= 0 for s in steps)
    assert recorded["samples"], "no memory samples"
    assert recorded["ops"], "no op window"
    (status,) = recorded["attach"]
    assert isinstance(status, ProbeStatus) and "before then are not seen" in status.detail
    return recorded


@needs_attach
def test_attach_starts_an_agent_in_a_plain_job(tmp_path: Path, jobs: list[Job]) -> None:
    job = Job(tmp_path, "--exit-code", "7")
    jobs.append(job)
    assert job.first_line == "first step done\n"
    assert not list_agents()
    _attach_and_check(job, tmp_path)
    code, out, err = job.finish()
    assert code == 7
    assert out == EXPECTED_STDOUT
    assert err.strip() == "stderr is the job's own"


@needs_attach
def test_attach_to_a_dataloader_loop_with_workers(tmp_path: Path, jobs: list[Job]) -> None:
    job = Job(tmp_path, "--workers", "2", "--exit-code", "3")
    jobs.append(job)
    _attach_and_check(job, tmp_path)
    # Each short epoch starts new workers: look until a set of them is up.
    deadline = time.monotonic() + 30
    while not psutil.Process(job.pid).children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert psutil.Process(job.pid).children(), "the job runs DataLoader workers"
    assert [a.pid for a in list_agents()] == [job.pid]  # the workers have no agent
    code, out, err = job.finish()
    assert (code, out) == (3, EXPECTED_STDOUT)
    assert err.strip() == "stderr is the job's own"


@needs_attach
def test_twenty_attaches_leave_one_agent(tmp_path: Path, jobs: list[Job]) -> None:
    job = Job(tmp_path, "--exit-code", "5")
    jobs.append(job)
    for i in range(20):
        record = tmp_path / f"r{i}.ttr"
        # A second: long enough for a frame on a busy machine (no frame recorded exits 1).
        result = torchtop(
            "attach", str(job.pid), "--headless", "--record", str(record), "--duration", "1"
        )
        assert result.returncode == 0, result.stderr
        assert ("starting an agent" in result.stderr) == (i == 0)
        assert [a.pid for a in list_agents()] == [job.pid]
    assert job.proc.poll() is None  # still training, with its agent and no viewer
    code, out, _ = job.finish()
    assert (code, out) == (5, EXPECTED_STDOUT)


# -- refusals -------------------------------------------------------------------------------


def _sleeper(python: str = sys.executable, *flags: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [python, *flags, "-c", "import time\nwhile True: time.sleep(0.05)"], cwd="/tmp"
    )
    time.sleep(0.5)
    return proc


def test_refused_without_gdb(tmp_path: Path) -> None:
    if sys.version_info >= inject.REMOTE_EXEC_PYTHON:
        pytest.skip("Python 3.14+ attaches with sys.remote_exec, not gdb")
    target = _sleeper()
    try:
        empty = tmp_path / "bin"
        empty.mkdir()
        record = tmp_path / "r.ttr"
        result = subprocess.run(
            [*ATTACH, str(target.pid), "--headless", "--record", str(record), "--duration", "1"],
            capture_output=True,
            text=True,
            env={**os.environ, "PATH": str(empty)},
            timeout=120,
        )
    finally:
        target.kill()
        target.wait()
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("torchtop: gdb is not installed")
    assert "apt install gdb" in lines[0] and "torchtop run" in lines[0]
    assert "Traceback" not in result.stderr
    # What can be read from outside is recorded all the same.
    assert (
        lines[1]
        == f"torchtop: watching pid {target.pid} from outside instead (/proc and NVML only)"
    )
    messages = read_recording(record).messages
    samples = [m for m in messages if isinstance(m, Sample)]
    assert samples and all(s.host is not None and s.host.rss_bytes for s in samples)
    assert samples[-1].host is not None and samples[-1].host.threads == 1
    (status,) = [m for m in messages if isinstance(m, ProbeStatus) and m.probe == "attach"]
    assert status.detail.startswith("watched from outside (gdb is not installed")


def test_refused_for_another_users_job(tmp_path: Path) -> None:
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("running the attacher as another user needs root and setpriv")
    target = _sleeper()  # ours (root); the attacher runs as nobody
    runtime = f"/tmp/tt-nobody-{os.getpid()}"  # nobody cannot enter the test's own tmp_path
    record = f"{runtime}.ttr"
    try:
        result = subprocess.run(
            [*AS_NOBODY, *ATTACH, str(target.pid), *HEADLESS_1S, "--record", record],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
            env={**os.environ, "TORCHTOP_RUNTIME_DIR": runtime, "HOME": "/tmp"},
            timeout=120,
        )
    finally:
        target.kill()
        target.wait()
        shutil.rmtree(runtime, ignore_errors=True)
    assert result.returncode == 1, result.stderr
    line = result.stderr.strip().splitlines()[0]
    assert line == (
        f"torchtop: pid {target.pid} belongs to root, not to you (nobody): run "
        f"`torchtop attach {target.pid}` as root"
    )
    assert "Traceback" not in result.stderr
    samples = [m for m in read_recording(record).messages if isinstance(m, Sample)]
    os.unlink(record)
    assert samples and samples[-1].host is not None and samples[-1].host.rss_bytes


def test_root_attaching_to_another_users_job_is_refused(tmp_path: Path) -> None:
    """Root (or any caller with CAP_SYS_PTRACE) is refused a job of another uid, as anyone is:
    the job's files are that user's, and torchtop runs none of them with more rights. The job
    runs on, and what /proc shows is watched from outside instead."""
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("starting a job as another user needs root and setpriv")
    target = subprocess.Popen(
        [*AS_NOBODY, sys.executable, "-I", "-c", "import time\nwhile True: time.sleep(0.05)"],
        cwd="/tmp",
    )
    time.sleep(0.5)
    record = tmp_path / "r.ttr"
    try:
        result = torchtop("attach", str(target.pid), *HEADLESS_1S, "--record", str(record))
        assert target.poll() is None  # untouched
    finally:
        target.kill()
        target.wait()
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0] == (
        f"torchtop: pid {target.pid} belongs to nobody, not to you (root): run "
        f"`torchtop attach {target.pid}` as nobody"
    )
    assert "sudo" not in result.stderr and "starting an agent" not in result.stderr
    assert not list_agents()


def test_the_ptrace_capability_does_not_reach_another_users_job(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self/status").write_text(f"CapEff:\t{1 << inject.CAP_SYS_PTRACE:016x}\n")
    theirs = inject.Target(pid=42, uid=os.getuid() + 1, exe="/usr/bin/python3.11", python=(3, 11))
    with pytest.raises(inject.AttachRefused, match=r"belongs to .*, not to you") as refused:
        inject.check_ptrace(theirs, proc)
    assert "sudo" not in str(refused.value)


def test_yama_scope_refusals_name_the_fix(tmp_path: Path) -> None:
    """A kernel with Yama: the refusal for each ptrace_scope (read from a /proc tree)."""
    proc = tmp_path / "proc"
    (proc / "sys/kernel/yama").mkdir(parents=True)
    (proc / "self").mkdir()
    (proc / "self/status").write_text("Name:\tx\nCapEff:\t0000000000000000\n")
    target = inject.Target(pid=42, uid=os.getuid(), exe="/usr/bin/python3.11", python=(3, 11))
    fixes = {1: "sudo sysctl kernel.yama.ptrace_scope=0", 2: "torchtop run", 3: "torchtop run"}
    for scope, fix in fixes.items():
        (proc / "sys/kernel/yama/ptrace_scope").write_text(f"{scope}\n")
        with pytest.raises(inject.AttachRefused, match=f"ptrace_scope={scope}") as refused:
            inject.check_ptrace(target, proc)
        assert fix in str(refused.value)
        assert "attach with sudo" not in str(refused.value)
    (proc / "self/status").write_text(f"CapEff:\t{1 << inject.CAP_SYS_PTRACE:016x}\n")
    (proc / "sys/kernel/yama/ptrace_scope").write_text("1\n")
    inject.check_ptrace(target, proc)  # CAP_SYS_PTRACE may trace under scope 1


@needs_attach
def test_refused_when_the_jobs_python_cannot_import_torchtop(tmp_path: Path) -> None:
    base = getattr(sys, "_base_executable", sys.executable)
    check = subprocess.run([base, "-I", "-c", "import torchtop"], capture_output=True, cwd="/tmp")
    if check.returncode == 0:
        pytest.skip(f"{base} imports torchtop: no Python without it here")
    target = _sleeper(base, "-I")  # isolated: no venv, no site-packages of ours
    try:
        refused = torchtop(
            "attach", str(target.pid), "--headless", "--record", str(tmp_path / "r.ttr"),
            "--duration", "0.5",
        )  # fmt: skip
        assert refused.returncode == 1
        line = refused.stderr.strip().splitlines()[1]  # after "starting an agent in pid …"
        assert line.startswith(f"torchtop: pid {target.pid}'s Python (")
        assert "cannot import torchtop (ModuleNotFoundError: No module named 'torchtop')" in line
        assert "torchtop run" in line and "Traceback" not in refused.stderr
        # The fix it names works, and the job runs on.
        fix = line.split("give --python-path ", 1)[1].split(",", 1)[0]
        accepted = torchtop(
            "attach", str(target.pid), "--headless", "--record", str(tmp_path / "r.ttr"),
            "--duration", "1", "--python-path", fix,
        )  # fmt: skip
        assert accepted.returncode == 0, accepted.stderr
        assert [a.pid for a in list_agents()] == [target.pid]
        assert target.poll() is None
    finally:
        target.kill()
        target.wait()


# -- the live viewer ------------------------------------------------------------------------


@needs_attach
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_the_viewer_asks_then_attaches(
    tmp_path: Path,
    jobs: list[Job],
    terminal: Terminal,  # noqa: F811 - the fixture
) -> None:
    job = Job(tmp_path, "--exit-code", "4")
    jobs.append(job)
    terminal.keys(f"{sys.executable} -m torchtop attach {job.pid}; echo EXIT=$?", "Enter")
    terminal.wait_for(lambda s: f"pid {job.pid} (" in s and "runs without torchtop" in s)
    assert not list_agents()  # nothing started before the answer
    terminal.keys("y", "Enter")
    terminal.wait_for(lambda s: "live" in s and f"pid {job.pid}" in s and "RSS" in s)
    assert [a.pid for a in list_agents()] == [job.pid]
    terminal.keys("q")
    assert "EXIT=0\n" in terminal.wait_for(lambda s: re.search(r"EXIT=\d+\n", s), timeout=30)
    assert [a.pid for a in list_agents()] == [job.pid]  # detached: the agent stays
    code, out, _ = job.finish()
    assert (code, out) == (4, EXPECTED_STDOUT)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_declining_watches_from_outside(
    tmp_path: Path,
    jobs: list[Job],
    terminal: Terminal,  # noqa: F811 - the fixture
) -> None:
    job = Job(tmp_path)
    jobs.append(job)
    terminal.keys(f"{sys.executable} -m torchtop attach {job.pid}; echo EXIT=$?", "Enter")
    terminal.wait_for(lambda s: "runs without torchtop" in s)
    terminal.keys("n", "Enter")
    screen = terminal.wait_for(lambda s: f"pid {job.pid}" in s and "peak RSS" in s)
    # At 80x24: RSS once (from outside it is all there is), why the view is from outside in
    # full, and no key that asks an agent for something.
    assert screen.count("■ RSS") == 1 and "RSS \N{MINUS SIGN} RSS" not in screen, screen
    assert "no agent started" in screen and "timings" in screen, screen
    assert "not imported yet" not in screen  # from outside, torch is unknown, not pending
    footer = [line for line in screen.splitlines() if line.strip()][-1]
    assert "Snapshot" not in footer and "Profile" not in footer, footer
    terminal.keys("q")
    assert "EXIT=1\n" in terminal.wait_for(lambda s: re.search(r"EXIT=\d+\n", s), timeout=30)
    assert not list_agents()  # no agent was started
    code, out, _ = job.finish()
    assert (code, out) == (0, EXPECTED_STDOUT)


# -- the injection itself, in each Python this machine has ------------------------------------


def _pythons() -> list[str]:
    """The real executables of python3.10 ... python3.13 found on PATH (pyenv shims resolved)."""
    found = []
    for minor in range(10, 14):
        name = shutil.which(f"python3.{minor}")
        if name is None:
            continue
        try:
            probe = subprocess.run(
                [name, "-c", "import sys; print(sys.executable)"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except subprocess.TimeoutExpired:  # a broken shim: that Python is left out
            continue
        if probe.returncode == 0 and probe.stdout.strip():
            found.append(probe.stdout.strip())
    return found


LOOPS = {
    "sleeping": "import time\nwhile True: time.sleep(0.01)",
    # No C-API call gdb waits at: gdb wakes the main thread with a pending no-op.
    "pure-python": "x = 0\nwhile True: x += 1",
}


@needs_attach
@pytest.mark.parametrize("loop", sorted(LOOPS))
@pytest.mark.parametrize("python", _pythons() or [sys.executable])
def test_gdb_runs_the_start_in_the_main_thread(tmp_path: Path, python: str, loop: str) -> None:
    if sys.version_info >= inject.REMOTE_EXEC_PYTHON:
        pytest.skip("Python 3.14+ attaches with sys.remote_exec")
    target = subprocess.Popen([python, "-I", "-c", LOOPS[loop]])
    proof = tmp_path / "ran"
    # Modules loaded before any script runs: the job may be starting up still.
    code = f"import _thread, os\nopen({str(proof)!r}, 'w').write(str(_thread.get_native_id()))"
    try:
        time.sleep(0.5)
        output = inject.run_gdb(target.pid, inject.gdb_script(inject.payload_line(code)), tmp_path)
        assert inject.MARK_SCHEDULED in output, output
        assert ("waking the main thread" in output) == (loop == "pure-python")
        deadline = time.monotonic() + 30
        while not proof.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proof.read_text() == str(target.pid)  # ran, in the main thread
        assert target.poll() is None  # and the job runs on
        assert not list(tmp_path.glob("*.gdb"))  # gdb's script is gone
    finally:
        target.kill()
        target.wait()


def test_remote_exec_never_runs_the_jobs_executable(tmp_path: Path) -> None:
    """Python 3.14+: ``sys.remote_exec`` is called from torchtop's own interpreter, never from
    the job's executable (a file its owner controls). Here the job's executable is a script that
    leaves a mark if run; the job claims a Python this torchtop does not run in, so the attach is
    refused, saying which Python torchtop needs."""
    mark = tmp_path / "ran"
    planted = tmp_path / "python3.14"
    planted.write_text(f"#!/bin/sh\ntouch {mark}\n")
    planted.chmod(0o755)
    target = _sleeper()
    try:
        job = inject.read_target(target.pid)
        other = (3, 99)
        as_other = inject.Target(pid=job.pid, uid=job.uid, exe=str(planted), python=other)
        with pytest.raises(inject.AttachRefused) as refused:
            inject.remote_exec(as_other, "pass", tmp_path)
        ours = ".".join(map(str, sys.version_info[:2]))
        assert str(refused.value).startswith(
            f"pid {target.pid} runs Python 3.99 and torchtop runs in Python {ours}:"
        )
        assert "torchtop run" in str(refused.value)
        assert not mark.exists()
        assert not list(tmp_path.glob("attach-*"))  # no script file left
    finally:
        target.kill()
        target.wait()


def test_gdb_reads_no_init_file_and_loads_no_script(tmp_path: Path) -> None:
    """gdb loads neither the user's init files nor the scripts beside the job's libraries."""
    command = inject.gdb_command(42, tmp_path / "x.gdb")
    assert command[0] == "gdb" and "-nx" in command
    assert "-iex=set auto-load off" in command
    assert command.index("-iex=set auto-load off") < command.index("-p")


# gdb's output where it cannot write the CPU's extended register state back (gdb 13.1, a CPU
# with AMX registers), recorded from `gdb -batch -p PID -ex "call (int)getpid()"`.
XSTATE_OUTPUT = """\
0x00007f3c1c2ed503 in clock_nanosleep () from /lib/x86_64-linux-gnu/libc.so.6
Couldn't write extended state status: Bad address.
[Inferior 1 (process 19296) detached]
"""


def test_a_gdb_that_cannot_restore_registers_is_named_with_the_fix() -> None:
    problem = inject.gdb_call_problem(XSTATE_OUTPUT)
    assert problem is not None
    assert "cannot call a function in a process on this machine" in problem
    assert "torchtop run" in problem
    refusal = inject._gdb_failure(19296, XSTATE_OUTPUT)
    assert str(refusal).startswith("cannot start an agent in pid 19296: gdb")
    assert inject.gdb_call_problem("$1 = 19296\n") is None


@pytest.mark.skipif(
    NO_ATTACH is None or "extended state" not in NO_ATTACH,
    reason="gdb can call into processes here: the refusal is for machines where it cannot",
)
def test_where_gdb_cannot_call_attach_refuses_before_touching_the_job(
    tmp_path: Path, jobs: list[Job]
) -> None:
    job = Job(tmp_path, "--exit-code", "7")
    jobs.append(job)
    out = torchtop("attach", str(job.pid), "--yes", "--headless", "--record",
                   str(tmp_path / "r.ttr"), "--duration", "1")  # fmt: skip
    assert "cannot call a function in a process on this machine" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    # gdb never stopped the job: it runs on and ends as it would have, nothing raised into it.
    code, stdout, stderr = job.finish()
    assert code == 7
    assert stdout == EXPECTED_STDOUT
    assert stderr.strip() == "stderr is the job's own"


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_a_process_that_is_not_python_is_refused_before_asking(
    terminal: Terminal,  # noqa: F811 - the fixture
) -> None:
    """No question about starting an agent in a shell or ``sleep``: it is not Python, and the
    answer says how to watch a training job (start it under ``torchtop run``)."""
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        terminal.keys(f"{sys.executable} -m torchtop attach {sleeper.pid}; echo EXIT=$?", "Enter")
        screen = terminal.wait_for(lambda s: re.search(r"EXIT=\d+\n", s), timeout=30)
        assert "Start an agent" not in screen
        assert f"pid {sleeper.pid} (/" in screen and "is not a Python process" in screen
        assert "torchtop run" in screen and "EXIT=1\n" in screen
        assert not list_agents()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_headless_attach_to_a_process_that_is_not_python_suggests_torchtop_run(
    tmp_path: Path,
) -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        out = torchtop(
            "attach", str(sleeper.pid), "--headless", "--record", "x.ttr", cwd=tmp_path, timeout=30
        )
        assert out.returncode == 1
        assert "is not a Python process" in out.stderr and "torchtop run SCRIPT" in out.stderr
        assert "from outside" not in out.stderr, out.stderr
    finally:
        sleeper.kill()
        sleeper.wait()
