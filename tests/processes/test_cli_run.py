"""`torchtop run` and friends as a user runs them: real processes, a real CPU training script."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import SCRIPTS, cuda_available, kill_tree, torchtop
from tests.conftest import report_json as _report
from torchtop.launch import python_module
from torchtop.protocol import AgentStats
from torchtop.streams.recording import read_recording
from torchtop.transport import AgentConnection, list_agents

TRAIN = str(SCRIPTS / "train_mlp.py")


def test_headless_run_records_and_reports(tmp_path: Path) -> None:
    rec = tmp_path / "r.ttr"
    out = torchtop(
        "run", "--headless", "--record", str(rec), TRAIN, "--steps", "40", "--sleep", "0.03"
    )
    assert out.returncode == 0, out.stderr
    assert "step 30 loss" in out.stdout  # the job's output comes through
    assert "training done" in out.stderr
    report = _report(rec)
    assert report["exit_code"] == 0
    assert report["samples"] / report["duration_s"] >= 5
    assert report["dropped"] == 0
    assert report["job"]["torch"]  # learnt once the job imported torch
    (cpu,) = report["devices"]
    assert cpu["id"] == "cpu" and cpu["name"]
    assert cpu["peak_allocated_bytes"] > 1 << 20
    assert cpu["peak_reserved_bytes"] >= cpu["peak_allocated_bytes"]
    assert report["host"]["peak_rss_bytes"] > 50 << 20
    assert report["phases"] == []
    assert report["log_lines"] >= 5  # the job's output is kept in the recording
    text = torchtop("report", str(rec))
    assert text.returncode == 0 and "peak allocated" in text.stdout


def test_exit_code_passes_through() -> None:
    out = torchtop("run", "--headless", TRAIN, "--steps", "2", "--exit-code", "3")
    assert out.returncode == 3


def test_uncaught_exception_exits_1_with_the_jobs_traceback(tmp_path: Path) -> None:
    rec = tmp_path / "r.ttr"
    out = torchtop("run", "--headless", "--record", str(rec), TRAIN, "--raise-at", "2")
    assert out.returncode == 1
    assert "Traceback (most recent call last)" in out.stderr
    assert "RuntimeError: boom at step 2" in out.stderr
    assert 'train_mlp.py", line' in out.stderr
    assert "bootstrap" not in out.stderr and "runpy" not in out.stderr
    report = _report(rec)
    assert report["exit_code"] == 1 and "RuntimeError" in report["exit_reason"]


def test_module_mode_and_phases(tmp_path: Path) -> None:
    pkg = tmp_path / "jobpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "main.py").write_text(
        "import sys, time, torchtop\n"
        "with torchtop.phase('warmup'):\n    time.sleep(0.4)\n"
        "torchtop.mark('half')\n"
        "with torchtop.phase('train'):\n    x = bytearray(64 << 20); time.sleep(0.4)\n"
        "print('args', sys.argv[1:])\n"
    )
    rec = tmp_path / "r.ttr"
    out = torchtop(
        "run", "--headless", "--record", str(rec), "-m", "jobpkg.main", "a", "-b", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert "args ['a', '-b']" in out.stdout
    phases = _report(rec)["phases"]
    assert [p["name"] for p in phases] == ["warmup", "train"]
    # Each phase slept 0.4 s; on a loaded machine its end may be seen late (the job's thread
    # waits for the CPU or the GIL), never early, and never by the job's whole length.
    durations = [p["duration_s"] for p in phases]
    assert all(0.35 < d < 10 for d in durations), durations
    assert phases[1]["peak_rss_bytes"] - phases[0]["peak_rss_bytes"] > 32 << 20


def test_module_options_belong_to_the_module(tmp_path: Path) -> None:
    """As under ``python -m``: everything after the module name is the module's, even options
    that look like torchtop's."""
    pkg = tmp_path / "jobpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "main.py").write_text("import sys\nprint('args', sys.argv[1:])\n")
    out = torchtop(
        "run", "--headless", "-m", "jobpkg.main", "--epochs", "3", "--record", "x", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert "args ['--epochs', '3', '--record', 'x']" in out.stdout
    assert not (tmp_path / "x").exists()
    out = _two_ranks(
        tmp_path, "import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n"
    )
    assert "rank 0 of 2" in out.stdout and "rank 1 of 2" in out.stdout


def _two_ranks(tmp_path: Path, script: str) -> subprocess.CompletedProcess[str]:
    """``script`` run by ``torchtop run -m torch.distributed.run`` in two ranks."""
    (tmp_path / "ddp.py").write_text(script)
    out = torchtop(
        "run", "--headless", "--no-ops", "-m", "torch.distributed.run", "--standalone",
        "--nproc_per_node=2", "ddp.py", cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out


def test_a_ranks_line_written_in_pieces_reaches_the_output_whole(tmp_path: Path) -> None:
    """Unbuffered, a line written in two pieces a moment apart was read by torchrun's tee
    between them and came out as ``[rank0]:rank[rank1]:rank[rank0]: 0 of 2``."""
    out = _two_ranks(
        tmp_path,
        "import os, sys, time\n"
        "sys.stdout.write('rank')\n"
        "time.sleep(0.4)\n"
        "print('', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n",
    )
    lines = out.stdout.splitlines()
    assert "[rank0]:rank 0 of 2" in lines and "[rank1]:rank 1 of 2" in lines, out.stdout


def test_file_is_absolute_as_under_python(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text("print('file', __file__)\n")
    out = torchtop("run", "--headless", "--no-ops", "job.py", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"file {tmp_path / 'job.py'}\n" in out.stdout


CTRL_C_JOB = """\
import time

def train():
    print("training", flush=True)
    time.sleep(60)

train()
"""


@pytest.mark.parametrize("launcher", ["python", "torchtop"])
def test_ctrl_c_shows_the_jobs_frames_and_dies_by_sigint(tmp_path: Path, launcher: str) -> None:
    """Ctrl-C at the terminal (SIGINT to the foreground process group) ends torchtop as it ends
    plain python: the job's frames only, and death by SIGINT."""
    (tmp_path / "job.py").write_text(CTRL_C_JOB)
    prefix = [sys.executable] if launcher == "python" else [sys.executable, "-m", "torchtop"]
    args = [] if launcher == "python" else ["run", "--headless", "--no-ops"]
    proc = subprocess.Popen(
        [*prefix, *args, "job.py"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "training\n"
    os.killpg(proc.pid, signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGINT, err
    assert "Traceback (most recent call last)" in err and "KeyboardInterrupt" in err
    assert 'job.py", line 7, in <module>' in err and "in train" in err
    assert "bootstrap" not in err and "runpy" not in err, err


def test_clear_errors_not_tracebacks(tmp_path: Path) -> None:
    for args, expected in [
        (["run", "--headless", "nope.py"], "no such script: nope.py"),
        (["run", "--headless"], "nothing to run"),
        (["run", "--interval", "-1", "x.py"], "must be positive"),
        (["run", "--bogus", "x.py"], "unrecognized arguments: --bogus"),
        (["run", "--headless", "-m", "no_such_module_xyz"], "no module named"),
        (["report", str(tmp_path / "missing.ttr")], "no recording at"),
        (["attach", "999999", "--headless", "--record", "x.ttr"], "no process 999999"),
        (["export", "999999", "--metrics", "127.0.0.1:0"], "no process 999999"),
        (["demo", "no-such-demo"], "no demo named"),
        (["frobnicate"], "invalid choice"),
    ]:
        out = torchtop(*args, cwd=tmp_path, timeout=30)
        assert out.returncode != 0, args
        assert expected in out.stderr, (args, out.stderr)
        assert "Traceback" not in out.stderr, args
        assert "see `ps`" not in out.stderr  # the system's ps, or torchtop's?


def test_export_of_a_run_with_no_job_yet_says_so_and_waits_for_it(tmp_path: Path) -> None:
    out = torchtop(
        "export", "nosuchrun", "--metrics", "127.0.0.1:0", "--duration", "1",
        cwd=tmp_path, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "no job of run nosuchrun is running yet" in out.stderr
    assert "serving metrics on http://127.0.0.1:" in out.stderr


@pytest.mark.skipif(cuda_available(), reason="a CUDA GPU is here: the demo would run on it")
def test_a_demo_asked_to_run_on_cuda_without_a_gpu_is_one_torchtop_line() -> None:
    out = torchtop("demo", "broadcasting", "--device", "cuda", "--headless", "--quick")
    assert out.returncode == 2
    assert out.stderr.startswith("torchtop: this PyTorch sees no CUDA GPU"), out.stderr
    assert "--device cpu" in out.stderr and len(out.stderr.splitlines()) == 1
    assert "device:" not in out.stdout  # the demo did not start


def test_export_of_a_process_without_an_agent_says_how_to_start_one() -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        out = torchtop("export", str(sleeper.pid), "--metrics", "127.0.0.1:0", timeout=30)
        assert out.returncode == 1
        assert f"pid {sleeper.pid} runs without torchtop's agent" in out.stderr
        assert "serving" not in out.stderr
    finally:
        sleeper.kill()
        sleeper.wait()


def test_damaged_recording_reads_to_the_last_whole_frame(tmp_path: Path) -> None:
    rec = tmp_path / "r.ttr"
    assert (
        torchtop("run", "--headless", "--record", str(rec), TRAIN, "--steps", "5").returncode == 0
    )
    data = rec.read_bytes()
    cut = tmp_path / "cut.ttr"
    cut.write_bytes(data[: len(data) // 2] + b"\x00garbage")
    contents = read_recording(cut)
    assert contents.truncated and contents.messages
    report = _report(cut)
    assert report["samples"] > 0 and report["recording"]["truncated"]
    end = report["recording"]["end_byte"]
    assert 0 < end <= len(data) // 2 and data[end - 1 : end] == b"\n"
    text = torchtop("report", str(cut))
    assert text.returncode == 0
    assert f"the recording is cut: it ends mid-frame at byte {end:,}" in " ".join(
        text.stdout.split()
    )
    assert "cut" not in torchtop("report", str(rec)).stdout


def test_empty_or_unreadable_recordings_are_errors(tmp_path: Path) -> None:
    for name, content, expected in [
        ("empty.ttr", b"", "is empty: nothing was recorded in it"),
        ("blank.ttr", b"\n\n", "is not a torchtop recording"),
        ("text.ttr", b"hello world\nnot frames\n", "is not a torchtop recording"),
        ("half.ttr", b'{"kind": "hel', "is not a torchtop recording"),
    ]:
        path = tmp_path / name
        path.write_bytes(content)
        for command in ("report", "replay"):
            out = torchtop(command, str(path))
            assert out.returncode == 1, (name, command, out.stderr)
            (line,) = out.stderr.splitlines()
            assert line.startswith(f"torchtop: {path} {expected}"), line
            assert out.stdout == ""


def _start_job(*extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "torchtop", "run", "--headless", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_agent(timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        agents = list_agents()
        if agents:
            return agents[0].pid
        time.sleep(0.1)
    raise AssertionError("no agent appeared")


def test_ps_attach_and_bad_peers_on_a_live_job(tmp_path: Path) -> None:
    job = _start_job(TRAIN, "--steps", "400", "--sleep", "0.02")
    try:
        pid = _wait_for_agent()
        listing = json.loads(torchtop("ps", "--json").stdout)
        assert listing[0]["pid"] == pid and listing[0]["address"].startswith("unix:")
        assert "train_mlp.py" in listing[0]["command"]
        path = listing[0]["address"].removeprefix("unix:")
        assert os.stat(path).st_mode & 0o777 == 0o600
        for payload in (
            os.urandom(2048) + b"\n",
            b"y" * (2 << 20),
            b'{"kind":"client_hello","protocol":999}\n',
        ):
            import socket

            bad = socket.socket(socket.AF_UNIX)
            bad.settimeout(5)
            bad.connect(path)
            try:
                bad.sendall(payload)
                assert bad.recv(1) == b""
            except (BrokenPipeError, ConnectionResetError):
                pass
            bad.close()
        rec = tmp_path / "a.ttr"
        out = torchtop("attach", str(pid), "--headless", "--record", str(rec), "--duration", "1")
        assert out.returncode == 0, out.stderr
        assert _report(rec)["samples"] >= 5
        assert job.poll() is None  # the job ran on through all of it
    finally:
        _interrupt(job)


def _interrupt(job: subprocess.Popen[str]) -> None:
    """Ctrl-C as a terminal sends it: to the job (the runner itself ignores SIGINT)."""
    for agent in list_agents():
        os.kill(agent.pid, signal.SIGINT)
    try:
        job.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # it ignored the Ctrl-C: fail, and leave nothing running
        kill_tree(job)
        raise


def test_job_killed_with_sigkill_is_reported(tmp_path: Path) -> None:
    rec = tmp_path / "r.ttr"
    job = _start_job("--record", str(rec), TRAIN, "--steps", "100000", "--sleep", "0.01")
    pid = _wait_for_agent()
    time.sleep(1.0)
    os.kill(pid, signal.SIGKILL)
    job.communicate(timeout=30)
    assert job.returncode == 128 + signal.SIGKILL
    report = _report(rec)
    assert report["exit_code"] == -signal.SIGKILL and "SIGKILL" in report["exit_reason"]
    assert report["samples"] > 0
    assert list_agents() == []  # the stale socket is cleaned up


def test_stalled_viewer_does_not_grow_the_agent() -> None:
    """A viewer stopped with SIGSTOP: its queue fills, drops are counted, memory stays bounded."""
    queue = 64
    job = subprocess.Popen(
        [
            *python_module("torchtop.agent.bootstrap"),
            TRAIN,
            "--steps",
            "100000",
            "--sleep",
            "0.01",
        ],
        env={
            **os.environ,
            "TORCHTOP_AGENT_OPTIONS": json.dumps({"client_queue": queue, "interval_s": 0.01}),
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    viewer = None
    try:
        pid = _wait_for_agent()
        address = list_agents()[0].address
        viewer = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from torchtop.transport import AgentConnection\n"
                f"for f in AgentConnection({address!r}).frames(): pass",
            ],
        )
        time.sleep(1.0)
        os.kill(viewer.pid, signal.SIGSTOP)
        stopped_at = time.time()
        watcher = AgentConnection(address)
        stats: list[AgentStats] = []
        for message in watcher.messages():
            # Skip the history replay; watch the agent while the viewer stays stopped.
            if isinstance(message, AgentStats) and message.t > stopped_at:
                stats.append(message)
                if message.dropped > 0 and message.t > stopped_at + 3:
                    break
        watcher.close()
        assert stats[-1].clients == 2
        assert stats[-1].dropped > 0
        # Bounded by the stalled viewer's queue plus one send buffer, not by how long it stalls.
        assert max(s.queued_bytes for s in stats) < queue * 4096 + (1 << 16)
        assert job.poll() is None and pid == list_agents()[0].pid
    finally:
        if viewer is not None:
            os.kill(viewer.pid, signal.SIGCONT)
            viewer.kill()
        job.send_signal(signal.SIGINT)
        try:
            job.wait(timeout=30)
        except subprocess.TimeoutExpired:
            job.kill()  # never leave a 100,000-step job behind a failed test
            raise


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_dataloader_workers_run_no_agent(tmp_path: Path, start_method: str) -> None:
    rec = tmp_path / "r.ttr"
    out = torchtop(
        "run", "--headless", "--record", str(rec), str(SCRIPTS / "loader_fork.py"), start_method
    )
    assert out.returncode == 0, out.stderr
    workers = [line for line in out.stdout.splitlines() if line.startswith("worker pid")]
    assert workers and all(line.endswith("agent no") for line in workers)
    assert "total 28 main agent yes" in out.stdout
    # The workers' output went through the job's captured stdout into the recording.
    logs = [m for m in read_recording(rec).messages if getattr(m, "stream", None) == "stdout"]
    assert any("worker pid" in m.text for m in logs)  # type: ignore[attr-defined]
    assert list_agents() == []


def test_one_line_start_in_the_script_then_attach(tmp_path: Path) -> None:
    job = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "inscript_start.py"), "4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        pid = _wait_for_agent()
        assert pid == job.pid
        rec = tmp_path / "a.ttr"
        out = torchtop("attach", "--headless", "--record", str(rec), "--duration", "30")
        assert out.returncode == 0, out.stderr
        report = _report(rec)
        assert report["job"]["pid"] == job.pid
        assert [p["name"] for p in report["phases"]] == ["work"]
        assert report["exit_reason"] == "interpreter exited"  # recorded until the job ended
    finally:
        job.communicate(timeout=30)
    assert job.returncode == 0
