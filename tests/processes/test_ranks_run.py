"""`torchtop run torchrun ...`: an agent in every rank of an unmodified DDP job, none in the
launcher or a DataLoader worker, and every rank in one recording and its report."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SCRIPTS, kill_tree, report_json, torchtop
from torchtop.agent.rank_start import (
    OWNER_ENV,
    OWNER_RANK_ENV,
    RANK_OPTIONS_ENV,
    job_environment,
    rank_environment,
    should_start,
)
from torchtop.protocol import Hello, LogLine
from torchtop.streams.recording import read_recording

#: What the run's rank rules can find (tests/unit/test_ranks_model.py has each).
RANK_FINDINGS = ("straggler", "hang", "rank_died")
RANK_ENV = {"RANK": "1", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "abc", RANK_OPTIONS_ENV: "{}"}


def test_only_a_rank_under_torchtop_run_starts_an_agent() -> None:
    assert should_start(RANK_ENV)
    # torchrun's elastic agent: no rank of its own.
    assert not should_start({RANK_OPTIONS_ENV: "{}", "TORCHELASTIC_RUN_ID": "abc"})
    # A process a rank started (a spawned DataLoader worker): the rank's agent marked it.
    assert not should_start({**RANK_ENV, OWNER_ENV: "123", OWNER_RANK_ENV: "torchrun:1"})
    # A rank outside `torchtop run`.
    assert not should_start({k: v for k, v in RANK_ENV.items() if k != RANK_OPTIONS_ENV})


def test_a_schedulers_task_or_lightnings_child_is_a_rank_its_workers_are_not() -> None:
    options = {RANK_OPTIONS_ENV: "{}"}
    slurm = {**options, "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2"}
    mpi = {**options, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    lightning = {**options, "LOCAL_RANK": "1", "WORLD_SIZE": "2", "NODE_RANK": "0"}
    for env in (slurm, mpi, lightning):
        assert should_start(env), env
        # The task's own DataLoader workers inherit its marks, and the mark of its agent.
        job = job_environment(env, {})
        assert not should_start(job), env
    # One task alone is a single process; so is a job with no launcher's marks (mp.spawn's
    # ranks get theirs when their process group exists).
    assert not should_start({**slurm, "SLURM_NTASKS": "1"})
    assert not should_start(job_environment({}, {}))
    # Lightning's parent has marked itself rank 0 when it starts rank 1 with LOCAL_RANK=1.
    parent = job_environment({**lightning, "LOCAL_RANK": "0"}, {})
    assert should_start({**parent, "LOCAL_RANK": "1"})


def test_the_sitecustomize_chains_the_one_it_displaces(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = '1'\n")
    env = rank_environment({**os.environ, "PYTHONPATH": str(theirs)}, {})
    out = subprocess.run(
        [sys.executable, "-c", "import os, sys; print(os.environ.get('THEIRS_RAN'), "
         f"os.environ.get('{OWNER_ENV}'), 'torchtop' in sys.modules)"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    # Theirs ran; this process is no rank, so it got no agent, nor any of torchtop's imports.
    assert out.stdout.split() == ["1", "None", "False"]


def test_a_process_that_never_joins_a_process_group_gets_no_agent(tmp_path: Path) -> None:
    env = job_environment(os.environ, {})
    code = (
        "import sys, torch, torch.distributed as dist; "
        "print('torchtop' in sys.modules, getattr(dist.init_process_group, '_torchtop', False))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    # init_process_group is wrapped, waiting; nothing of torchtop was imported.
    assert out.stdout.split() == ["False", "True"]


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
    # Each rank's result on a line of its own, behind its own rank's prefix.
    results = re.findall(r"^\[rank(\d+)\]:RESULT (\{[^{}]*\})$", out.stdout, re.M)
    assert sorted(int(rank) for rank, _ in results) == list(range(world)), out.stdout
    assert all(json.loads(result)["rank"] == int(rank) for rank, result in results)
    return record


def test_each_ranks_lines_show_once_behind_its_rank_and_the_launchers_bare(
    tmp_path: Path,
) -> None:
    record = tmp_path / "r.ttr"
    out = torchtop(
        "run", "--headless", "--record", str(record), "--no-ops", "-m", "torch.distributed.run",
        "--standalone", "--nproc_per_node=3", str(SCRIPTS / "ddp.py"), "--say", "2",
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    said = {"stdout": "says", "stderr": "warns"}
    for stream, text in (("stdout", out.stdout), ("stderr", out.stderr)):
        lines = text.splitlines()
        for rank in range(3):
            for i in range(2):
                line = f"rank {rank} {said[stream]} {i}"
                # Once, behind its own rank's prefix, on the stream it was written to.
                assert lines.count(f"[rank{rank}]:{line}") == 1, text
                assert sum(line in other for other in lines) == 1, text
    # The launcher's own lines (torchrun's warning) have no prefix.
    assert any(line.startswith("Setting OMP_NUM_THREADS") for line in out.stderr.splitlines())
    # The recording holds each line once, as it was shown.
    logged = [
        (m.stream, m.text)
        for m in read_recording(record).messages
        if isinstance(m, LogLine) and re.search(r"rank \d (says|warns)", m.text)
    ]
    assert sorted(logged) == sorted(
        (stream, f"[rank{rank}]:rank {rank} {said[stream]} {i}")
        for stream in said
        for rank in range(3)
        for i in range(2)
    )


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
    # Nothing wrong with the ranks (the advisor may still say 4 ranks oversubscribe 2 CPUs).
    assert report["exit_code"] == 0
    assert [f for f in report["findings"] if f["name"] in RANK_FINDINGS] == []
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
    from torchtop.streams.runner import RunSpec

    script = tmp_path / "train.py"
    script.write_text("")
    script.chmod(0o755)
    assert RunSpec(["-m", "torch.distributed.run", "train.py"]).launcher
    assert RunSpec([sys.executable, "-m", "torch.distributed.run", "train.py"]).launcher
    assert RunSpec(["sh", "-c", "true"]).launcher  # any program on PATH
    assert not RunSpec([str(script)]).launcher
    assert not RunSpec(["-m", "json.tool"]).launcher


# -- stragglers ----------------------------------------------------------------------------------


def _ddp_report(tmp_path: Path, world: int, *script_args: str) -> dict[str, Any]:
    record = _run_ddp(tmp_path, [sys.executable, "-m", "torch.distributed.run"], world,
                      *script_args)  # fmt: skip
    return dict(report_json(record))


def _named(report: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["name"] == name]


@pytest.mark.parametrize(
    ("world", "where", "cause"), [(4, "data", "data"), (3, "forward", "compute")]
)
def test_a_rank_slower_by_30_ms_per_step_is_named_straggler_with_its_cause(
    tmp_path: Path, world: int, where: str, cause: str
) -> None:
    report = _ddp_report(
        tmp_path, world, "--steps", "120", "--slow-rank", "2", "--slow-ms", "30",
        "--slow-in", where,
    )  # fmt: skip
    (finding,) = _named(report, "straggler")
    assert finding["rank"] == 2 and finding["severity"] in ("warning", "critical")
    evidence = finding["evidence"]
    assert evidence["score"] >= 0.10 and evidence["cause"] == cause
    # The others waited for it in backward; it waited least.
    times = {r["rank"]: r for r in evidence["ranks"]}
    assert min(times, key=lambda r: times[r]["backward_s"]) == 2
    # The gap is about the 30 ms it slept: the evidence is the measure, not a guess.
    assert 0.015 < evidence["gap_s"] < 0.100
    assert "rank 2" in finding["summary"]
    assert {r["rank"] for r in report["ranks"]} == set(range(world))


def test_a_balanced_run_names_no_straggler(tmp_path: Path) -> None:
    # Every rank sleeps the same 40 ms per step: a step long beside this machine's CPU noise.
    report = _ddp_report(tmp_path, 3, "--steps", "100", "--sleep-ms", "40")
    assert _named(report, "straggler") == []
    assert all(r["recent_backward_s"] for r in report["ranks"])  # measured, not absent


# -- hangs and dead ranks ------------------------------------------------------------------------


def test_a_rank_blocked_before_a_collective_is_named_with_its_line_and_a_killed_rank_dead(
    tmp_path: Path,
) -> None:
    from torchtop.report.run import summarize_ranks

    pids = tmp_path / "pids"
    pids.mkdir()
    record = tmp_path / "r.ttr"
    job = subprocess.Popen(
        [sys.executable, "-m", "torchtop", "run", "--headless", "--record", str(record),
         "--no-ops", "--hang-after", "3", sys.executable, "-m", "torch.distributed.run",
         "--standalone", "--nproc_per_node=4", str(SCRIPTS / "ddp.py"), "--pids", str(pids),
         "--steps", "50", "--block-rank", "1", "--block-at", "5"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # Rank 1 blocks forever; the others wait for it in the all-reduce. Watch the recording
        # as it grows until the run's model names the hang with rank 1's stack.
        deadline = time.monotonic() + 180
        hang: list[dict[str, Any]] = []
        while not hang and time.monotonic() < deadline and job.poll() is None:
            time.sleep(1.0)
            if record.exists() and record.stat().st_size:
                contents = read_recording(record)
                report = summarize_ranks(contents.messages, contents.sources)
                hang = [f for f in report["findings"] if f["name"] == "hang" and f["rank"] == 1]
        assert hang, "no hang named before the deadline"
        # Then rank 3 dies as the OOM killer would kill it.
        (rank3,) = [int(f.name.split("-")[1]) for f in pids.iterdir() if f.read_text() == "3"]
        os.kill(rank3, signal.SIGKILL)
        job.wait(180)
    finally:
        if job.poll() is None:  # a failed test leaves no launcher or rank blocked forever
            kill_tree(job)
    report = dict(report_json(record))
    # (A machine slow enough to pause a step for 3 s may add a brief hang before it.)
    *_, hang_finding = [f for f in _named(report, "hang") if f["rank"] == 1]
    assert hang_finding["severity"] == "critical"
    evidence = hang_finding["evidence"]
    assert evidence["threshold_s"] == 3.0 and evidence["outside_collective"] == [1]
    assert sorted(evidence["in_collective"]) == [0, 2, 3]
    (row,) = [r for r in evidence["ranks"] if r["rank"] == 1]
    source = (SCRIPTS / "ddp.py").read_text().splitlines()
    assert row["file"] == str(SCRIPTS / "ddp.py") and "BLOCKS HERE" in source[row["line"] - 1]
    # Rank 3 is dead with the launcher's exit code; the others were stopped after it.
    died = {f["rank"]: f for f in _named(report, "rank_died")}
    assert died[3]["severity"] == "critical" and died[3]["evidence"]["exit_code"] == -9
    ranks = {r["rank"]: r for r in report["ranks"]}
    assert ranks[3]["state"] == "dead" and ranks[3]["exit_code"] == -9
    assert all(ranks[r]["exit_code"] not in (None, 0) for r in (0, 1, 2))
    # The ranks waiting in the hang took their batches with their steps: no evaluation.
    assert _named(report, "eval-with-grad") == []


def test_four_single_threaded_ranks_on_two_cpus_blame_the_processes_not_the_threads(
    tmp_path: Path,
) -> None:
    # Four ranks pinned to two CPUs, each already at torch.set_num_threads(1), with op windows
    # (they say how many threads torch has).
    record = tmp_path / "r.ttr"
    out = subprocess.run(
        ["taskset", "-c", "0,1", sys.executable, "-m", "torchtop", "run", "--headless",
         "--record", str(record), sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc_per_node=4", str(SCRIPTS / "ddp.py"), "--threads", "1", "--steps", "400",
         "--sleep-ms", "20"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = report_json(record)
    findings = [f for f in report["findings"] if f["name"] == "cpu-oversubscription"]  # type: ignore[union-attr]
    assert findings, report["findings"]
    for finding in findings:
        assert finding["evidence"]["torch_threads"] == 1 and finding["evidence"]["cpus"] == 2
        assert "4 processes" in finding["summary"] and "2 CPUs" in finding["summary"]
        # Never the fix the job already applies.
        assert "set_num_threads" not in (finding["code"] or "") + finding["fix"]
