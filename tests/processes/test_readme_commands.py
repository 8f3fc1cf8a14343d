"""Every ``torchtop`` command line of the README's shell blocks is accepted by the real CLI and
runs: headless ones as written, viewer ones with ``--headless`` (the viewer itself is driven in
tmux by test_tui_tmux.py). Commands that run until stopped or take long are run by their own
tests (:data:`RUN_ELSEWHERE`); here they are parsed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, torchtop
from torchtop import commands as cli
from torchtop.transport import list_agents

#: README placeholders and the concrete values this test runs them with.
PLACEHOLDERS = [
    ("[PID]", "{pid}"),
    ("PID", "{pid}"),
    ("[--json]", "--json"),
    ("[--headless] [--quick]", "--headless --quick"),
    ("NAME", "broadcasting"),
    ("cpu|cuda", "cpu"),
    ("--duration 60", "--duration 1"),  # a minute of recording is the user's, not the test's
    ("--metrics 9481", "--metrics 127.0.0.1:0"),  # a free port: other tests may hold 9481
    ("DIR", "{tmp}"),
]

#: Subcommands whose runs other tests make: the demos take seconds each, an export and a relay
#: serve until stopped.
RUN_ELSEWHERE = {"demo": "test_demos.py", "export": "test_export.py", "relay": "test_nodes.py"}

TRAIN = """\
import argparse, time
p = argparse.ArgumentParser()
p.add_argument("--lr", type=float, default=0.1)
print("lr", p.parse_args().lr)
time.sleep(0.3)
"""

MODULE = """\
import argparse, sys
p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, required=True)
print("epochs", p.parse_args().epochs, "file", __file__)
"""

JOB = "import time\nwhile True:  # until the test ends it\n    time.sleep(0.1)\n"


def readme_commands(pages: list[Path] | None = None) -> list[str]:
    """The ``torchtop`` command lines of the ``sh`` blocks of ``pages`` (the README's by
    default), comments removed, each once."""
    text = "\n".join(page.read_text() for page in (pages or [REPO / "README.md"]))
    lines = []
    for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            for part in line.split("#", 1)[0].split(";"):
                part = part.strip()
                if part.startswith("torchtop ") and part not in lines:
                    lines.append(part)
    return lines


def concrete(line: str, pid: int, tmp: Path) -> list[str]:
    for placeholder, value in PLACEHOLDERS:
        line = line.replace(placeholder, value)
    return line.format(pid=pid, tmp=tmp).split()[1:]


def is_viewer(argv: list[str]) -> bool:
    command = argv[0]
    if command in ("run", "attach"):
        return "--headless" not in argv
    if command == "demo":
        return "--headless" not in argv and "--list" not in argv and "--source" not in argv
    return command == "replay"


def test_the_readme_lists_commands() -> None:
    commands = readme_commands()
    assert "torchtop run -m mypkg.train --epochs 3" in commands
    assert len(commands) >= 10


def test_every_readme_command_parses_and_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_commands(readme_commands(), tmp_path, monkeypatch)


def run_commands(commands: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As a user runs them: in the environment torchtop is installed in (its scripts, such as
    # torchrun, on PATH, as in an activated venv).
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "train.py").write_text(MODULE)
    (tmp_path / "job.py").write_text(JOB)
    job = subprocess.Popen(
        [sys.executable, "-m", "torchtop", "run", "--headless", "--no-ops", "job.py"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # torchtop and its job: one group to end together
    )
    try:
        deadline = time.monotonic() + 60
        while not list_agents() and time.monotonic() < deadline:
            time.sleep(0.1)
        (agent,) = list_agents()
        for line in commands:
            argv = concrete(line, agent.pid, tmp_path)
            cli.parse_args(argv)  # raises CliError for a line the CLI rejects
            if argv[0] in RUN_ELSEWHERE and argv[1:2] != ["--list"] and "--source" not in argv:
                continue
            if "--node" in argv:
                continue  # other nodes' ranks, in the viewer only: test_nodes.py
            if "--prometheus" in argv:
                continue  # a run through Prometheus: test_prometheus_attach.py
            if is_viewer(argv):
                if argv[0] == "replay":
                    out = torchtop(*argv, cwd=tmp_path)
                    assert "needs a terminal" in out.stderr, (line, out.stderr)
                    continue
                argv = [argv[0], "--headless", *argv[1:]]
                if argv[0] == "attach":
                    argv += ["--record", "attached.ttr", "--duration", "1"]
            if "--metrics" in argv:  # a free port: other tests may serve on the README's
                argv[argv.index("--metrics") + 1] = "127.0.0.1:0"
            if argv[0] == "export":
                if "--metrics" not in argv and "--otlp" not in argv:
                    argv += ["--metrics", "127.0.0.1:0"]
                argv += ["--duration", "1"]  # it serves until interrupted, or the job ends
            out = torchtop(*argv, cwd=tmp_path)
            assert out.returncode == 0, (line, out.stderr)
            assert "Traceback" not in out.stderr, line
            if "mypkg.train" in argv:
                assert "epochs 3 file " + str(tmp_path / "mypkg" / "train.py") in out.stdout
            if argv == ["ps"]:
                assert str(agent.pid) in out.stdout
            if "train.py" in argv and "--lr" in argv:
                assert "lr 0.0003" in out.stdout
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
