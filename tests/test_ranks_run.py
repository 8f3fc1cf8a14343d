"""`torchtop run torchrun ...`: an agent in every rank of an unmodified DDP job, none in the
launcher or a DataLoader worker, and every rank in one recording and its report."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SCRIPTS, report_json, torchtop
from torchtop.agent.rank_start import OWNER_ENV, RANK_OPTIONS_ENV, rank_environment, should_start
from torchtop.protocol import Hello
from torchtop.recording import read_recording

RANK_ENV = {"RANK": "1", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "abc", RANK_OPTIONS_ENV: "{}"}


def test_only_a_rank_under_torchtop_run_starts_an_agent() -> None:
    assert should_start(RANK_ENV)
    # torchrun's elastic agent: no rank of its own.
    assert not should_start({RANK_OPTIONS_ENV: "{}", "TORCHELASTIC_RUN_ID": "abc"})
    # A process a rank started (a spawned DataLoader worker): the rank's agent marked it.
    assert not should_start({**RANK_ENV, OWNER_ENV: "123"})
    # A rank outside `torchtop run`.
    assert not should_start({k: v for k, v in RANK_ENV.items() if k != RANK_OPTIONS_ENV})


def test_the_sitecustomize_chains_the_one_it_displaces(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = '1'\n")
    env = rank_environment({**os.environ, "PYTHONPATH": str(theirs)}, {})
    out = subprocess.run(
        [sys.executable, "-c", "import os, sys; print(os.environ.get('THEIRS_RAN'), "
         f"os.environ.get('{OWNER_ENV}'), 'torchtop.agent.core' in sys.modules)"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    # Theirs ran; this process is no rank, so it got no agent.
    assert out.stdout.split() == ["1", "None", "False"]


def _run_ddp(tmp_path: Path, launcher: list[str], world: int, *script_args: str) -> Path:
    pids = tmp_path / "pids"
    pids.mkdir()
    record = tmp_path / "r.ttr"
    out = torchtop(
        "run", "--headless", "--record", str(record), "--no-ops", *launcher, "--standalone",
        f"--nproc_per_node={world}", str(SCRIPTS / "ddp.py"), "--pids", str(pids),
        *script_args, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    # Four ranks write to one pipe: another rank's output can land on the same line.
    results = [json.loads(m) for m in re.findall(r"RESULT (\{[^{}]*\})", out.stdout)]
    assert sorted(r["rank"] for r in results) == list(range(world)), out.stdout
    return record


def _roles(tmp_path: Path) -> dict[str, dict[int, int]]:
    """pid -> rank for each role the job's processes wrote down."""
    roles: dict[str, dict[int, int]] = {"rank": {}, "worker": {}}
    for f in (tmp_path / "pids").iterdir():
        role, pid = f.name.split("-")
        roles[role][int(pid)] = int(f.read_text())
    return roles


def test_torchrun_under_torchtop_records_every_rank_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `torchrun` as a user types it: found on PATH, next to this Python.
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    record = _run_ddp(
        tmp_path, ["torchrun"], 4, "--steps", "5", "--workers", "1", "--start-method", "spawn"
    )
    roles = _roles(tmp_path)
    assert len(roles["rank"]) == 4 and len(roles["worker"]) == 4
    contents = read_recording(record)
    hellos = {
        m.pid: (m.rank, source)
        for m, source in zip(contents.messages, contents.sources, strict=True)
        if isinstance(m, Hello)
    }
    # One agent per rank, each in its rank's process and tagged as its source: none in the
    # launcher, none in a worker.
    assert {pid: rank for pid, (rank, _) in hellos.items()} == roles["rank"]
    assert all(source == str(pid) for pid, (_, source) in hellos.items())

    report = report_json(record)
    ranks = report["ranks"]
    assert isinstance(ranks, list)
    assert [(r["rank"], r["pid"], r["steps"]) for r in ranks] == [
        (rank, pid, 5) for pid, rank in sorted(roles["rank"].items(), key=lambda x: x[1])
    ]
    # Each rank's agent sent its end (a rank's exit code is the launcher's to know: null).
    assert all(r["step_time_s"] and r["exit_reason"] != "no exit recorded" for r in ranks)
    assert report["exit_code"] == 0 and report["findings"] == []
    assert report["job"]["world_size"] == 4  # type: ignore[index]


def test_python_m_torch_distributed_run_gives_each_rank_one_agent(tmp_path: Path) -> None:
    # The script starts its own agent too: the rank keeps the one it has.
    script = tmp_path / "own.py"
    script.write_text(
        "import runpy, sys, torchtop\ntorchtop.start()\n"
        f"sys.argv[0] = {str(SCRIPTS / 'ddp.py')!r}\n"
        f"runpy.run_path({str(SCRIPTS / 'ddp.py')!r}, run_name='__main__')\n"
    )
    record = tmp_path / "r.ttr"
    (tmp_path / "pids").mkdir()
    out = torchtop(
        "run", "--headless", "--record", str(record), "--no-ops", sys.executable, "-m",
        "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
        "--pids", str(tmp_path / "pids"), "--steps", "3", timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    contents = read_recording(record)
    # The agents in the recording (each says hello again once torch is imported): the ranks'.
    hellos = {m.pid for m in contents.messages if isinstance(m, Hello)}
    assert hellos == set(_roles(tmp_path)["rank"])
    assert [r["steps"] for r in report_json(record)["ranks"]] == [3, 3]  # type: ignore[index]


def test_launchers_are_told_from_scripts(tmp_path: Path) -> None:
    from torchtop.runner import RunSpec

    script = tmp_path / "train.py"
    script.write_text("")
    script.chmod(0o755)
    assert RunSpec(["-m", "torch.distributed.run", "train.py"]).launcher
    assert RunSpec([sys.executable, "-m", "torch.distributed.run", "train.py"]).launcher
    assert RunSpec(["sh", "-c", "true"]).launcher  # any program on PATH
    assert not RunSpec([str(script)]).launcher
    assert not RunSpec(["-m", "json.tool"]).launcher
