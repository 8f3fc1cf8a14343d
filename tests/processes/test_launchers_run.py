"""`torchtop run` on a multi-process job that torchrun did not start: the ranks that
``torch.multiprocessing.spawn``, Lightning's launcher, or a scheduler's tasks (SLURM, Open MPI,
simulated by their variables) start each get an agent, and the recording, the report and the
run's id see them as they see torchrun's; the parent that only waits is the launcher."""

from __future__ import annotations

import contextlib
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

from tests.conftest import SCRIPTS, report_json, torchtop
from torchtop.protocol import Hello
from torchtop.streams.recording import read_recording

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _run(tmp_path: Path, *args: str, script: str = "ddp.py") -> tuple[Path, Any]:
    record = tmp_path / "r.ttr"
    out = torchtop(
        "run", "--headless", "--record", str(record), "--no-ops", str(SCRIPTS / script),
        *args, timeout=300,
    )  # fmt: skip
    return record, out


def _roles(folder: Path) -> dict[str, dict[int, int]]:
    """pid -> rank for each role the job's processes wrote down."""
    roles: dict[str, dict[int, int]] = {"rank": {}, "worker": {}}
    for f in folder.iterdir():
        role, pid = f.name.split("-")
        roles[role][int(pid)] = int(f.read_text())
    return roles


def _hellos(record: Path) -> dict[int, tuple[Hello, str | None]]:
    """Each agent's last hello in the recording, with the source its frames are tagged with."""
    contents = read_recording(record)
    return {
        m.pid: (m, source)
        for m, source in zip(contents.messages, contents.sources, strict=True)
        if isinstance(m, Hello)
    }


def _results(stdout: str) -> dict[int, dict[str, int]]:
    found = [json.loads(x) for x in re.findall(r"RESULT (\{[^{}]*\})", stdout)]
    return {r.get("rank", i): r for i, r in enumerate(found)}


@pytest.mark.parametrize("world", [2, 3])
def test_mp_spawn_ranks_are_recorded_each_with_its_steps_and_the_parent_is_the_launcher(
    tmp_path: Path, world: int
) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    record, out = _run(tmp_path, "--spawn", str(world), "--steps", "7", "--pids", str(pids))
    assert out.returncode == 0, out.stderr
    assert sorted(_results(out.stdout)) == list(range(world)), out.stdout
    roles = _roles(pids)
    hellos = _hellos(record)
    # One agent per rank, tagged as its own source, and the job's own (the parent that only
    # waits) untagged, with no rank: the launcher.
    ranked = {pid: hello.rank for pid, (hello, _) in hellos.items() if hello.rank is not None}
    assert ranked == roles["rank"]
    assert all(source == str(pid) for pid, (hello, source) in hellos.items() if pid in ranked)
    (parent,) = [hello for hello, source in hellos.values() if source is None]
    assert parent.rank is None and parent.pid not in ranked
    # Every rank of the one run.
    run_ids = {hello.run_id for pid, (hello, _) in hellos.items() if pid in ranked}
    assert len(run_ids) == 1 and None not in run_ids

    report = report_json(record)
    ranks = report["ranks"]
    assert isinstance(ranks, list)
    assert [(r["rank"], r["pid"], r["steps"]) for r in ranks] == [
        (rank, pid, 7) for pid, rank in sorted(roles["rank"].items(), key=lambda x: x[1])
    ]
    assert all(r["exit_code"] == 0 and r["state"] == "exited" for r in ranks)
    # The run's exit is the parent's; the report's steps are rank 0's.
    assert report["exit_code"] == 0 and report["steps"] == 7
    assert report["job"]["world_size"] == world  # type: ignore[index]


def test_a_failing_mp_spawn_rank_makes_the_runs_exit_code(tmp_path: Path) -> None:
    record, out = _run(tmp_path, "--spawn", "2", "--steps", "3", "--fail-rank", "1")
    assert out.returncode == 1, out.stderr
    report = report_json(record)
    assert report["exit_code"] == 1
    ranks = {r["rank"]: r for r in report["ranks"]}  # type: ignore[union-attr]
    assert set(ranks) == {0, 1}


@pytest.mark.parametrize("scheduler", ["slurm", "mpi"])
def test_a_schedulers_tasks_are_found_and_named_by_its_variables(
    tmp_path: Path, scheduler: str
) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    record, out = _run(
        tmp_path, "--tasks", scheduler, "--world", "2", "--steps", "5", "--pids", str(pids)
    )
    assert out.returncode == 0, out.stderr
    roles = _roles(pids)
    hellos = _hellos(record)
    # The tasks trained with no process group: only the scheduler's variables say which.
    ranked = {pid: hello for pid, (hello, _) in hellos.items() if hello.rank is not None}
    assert {pid: hello.rank for pid, hello in ranked.items()} == roles["rank"]
    assert {(h.rank, h.local_rank, h.world_size) for h in ranked.values()} == {
        (0, 0, 2),
        (1, 1, 2),
    }
    run_ids = {h.run_id for h in ranked.values()}
    assert run_ids == ({"slurm-4242.0"} if scheduler == "slurm" else run_ids) and len(run_ids) == 1
    report = report_json(record)
    assert [(r["rank"], r["steps"]) for r in report["ranks"]] == [(0, 5), (1, 5)]  # type: ignore[union-attr]


def test_dataloader_workers_under_mp_spawn_ranks_get_no_agent(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    record, out = _run(
        tmp_path, "--spawn", "2", "--steps", "4", "--workers", "1", "--start-method", "spawn",
        "--pids", str(pids),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    roles = _roles(pids)
    # A worker a rank: each spawned worker imports torch, and a second one would show nothing
    # the first does not.
    assert len(roles["rank"]) == 2 and len(roles["worker"]) == 2
    hellos = _hellos(record)
    agents = {pid for pid, (_, source) in hellos.items() if source is not None}
    assert agents == set(roles["rank"])
    assert not agents & set(roles["worker"])


def test_lightnings_ddp_launcher_gives_both_ranks_their_global_steps(tmp_path: Path) -> None:
    record, out = _run(
        tmp_path, "--devices", "2", "--epochs", "2", "--forward-sleep", "0", "--workers", "0",
        script="lightning_fit.py",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    # The two ranks share the job's stdout: their lines may come in one write.
    own = [json.loads(x) for x in re.findall(r"RESULT (\{[^{}]*\})", out.stdout)]
    assert len(own) == 2 and own[0]["global_step"] == own[1]["global_step"] == 12
    report = report_json(record)
    ranks = report["ranks"]
    # Rank 0 is the job's own process (Lightning's launcher runs there), rank 1 its child.
    assert [(r["rank"], r["steps"]) for r in ranks] == [(0, 12), (1, 12)]  # type: ignore[union-attr]
    assert report["exit_code"] == 0 and report["steps"] == 12


def test_ps_shows_mp_spawn_ranks_as_one_run_under_their_launcher(tmp_path: Path) -> None:
    job = subprocess.Popen(
        [sys.executable, "-m", "torchtop", "run", "--headless", "--no-ops",
         str(SCRIPTS / "ddp.py"), "--spawn", "2", "--steps", "3000", "--sleep-ms", "5"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        listed: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            listed = json.loads(torchtop("ps", "--json").stdout)
            if sorted(a["rank"] for a in listed if a["rank"] is not None) == [0, 1]:
                break
            time.sleep(0.5)
        ranks = sorted((a for a in listed if a["rank"] is not None), key=lambda a: a["rank"])
        (run_id,) = {a["run_id"] for a in ranks}
        # The job's own process: no rank, the launcher of the ranks' run.
        (parent,) = [a for a in listed if a["rank"] is None]
        assert parent["launches"] == run_id
        table = torchtop("ps").stdout.splitlines()
        head = table.index(f"run {run_id}: 2 ranks of 2")
        rows = [line.split() for line in table[head + 1 : head + 4]]
        assert [row[0] for row in rows] == [str(parent["pid"]), *(str(a["pid"]) for a in ranks)]
        assert [row[3] for row in rows] == ["launcher", "0/2", "1/2"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()


def test_the_straggler_rule_names_a_slow_mp_spawn_rank(tmp_path: Path) -> None:
    record, out = _run(
        tmp_path, "--spawn", "3", "--steps", "120", "--slow-rank", "1", "--slow-ms", "30",
        "--slow-in", "data",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = report_json(record)
    findings = report["findings"]
    assert isinstance(findings, list)
    (finding,) = [f for f in findings if f["name"] == "straggler"]
    assert finding["rank"] == 1 and finding["evidence"]["cause"] == "data"
    assert "rank 1" in finding["summary"]


SPAWN_WITH_START = """
import os, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp
import torchtop

def worker(rank, world, port):
    torchtop.start()  # before the process group: the agent learns its rank from it
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.1)
    dist.destroy_process_group()

if __name__ == "__main__":
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port), nprocs=2)
"""


def test_mp_spawn_ranks_that_start_torchtop_themselves_are_one_run_to_attach(
    tmp_path: Path,
) -> None:
    script = tmp_path / "spawned.py"
    script.write_text(SPAWN_WITH_START)
    done = tmp_path / "done"
    # Started without torchtop: only torchtop.start() in each rank.
    job = subprocess.Popen([sys.executable, str(script), str(done)], start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        ranks: list[dict[str, Any]] = []
        while len(ranks) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
            listed = json.loads(torchtop("ps", "--json").stdout)
            ranks = [a for a in listed if a["rank"] is not None and a["run_id"]]
        assert sorted((a["rank"], a["world_size"]) for a in ranks) == [(0, 2), (1, 2)]
        (run_id,) = {a["run_id"] for a in ranks}
        assert run_id.startswith("pg-127.0.0.1:")
        # `attach` with no PID sees one run of ranks (the viewer opens the run's view; a
        # headless recording asks which rank).
        out = torchtop("attach", "--headless", "--record", str(tmp_path / "r.ttr"))
        assert out.returncode == 1 and f"are the ranks of run {run_id}" in out.stderr
        done.write_text("")
        assert job.wait(60) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()


def test_accelerate_launch_gives_each_process_its_agent(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    accelerate = Path(sys.executable).parent / "accelerate"
    record = tmp_path / "r.ttr"
    # `--cpu` makes accelerate run one process (more need mpirun); `--multi_gpu` runs its
    # torchrun, and the script's Accelerator(cpu=True) trains on the CPU with gloo.
    out = torchtop(
        "run", "--headless", "--record", str(record), "--no-ops", str(accelerate), "launch",
        "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", str(SCRIPTS / "accelerate_ddp.py"), timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert sorted(_results(out.stdout)) == [0, 1], out.stdout
    report = report_json(record)
    assert [(r["rank"], r["steps"]) for r in report["ranks"]] == [(0, 8), (1, 8)]  # type: ignore[union-attr]


def test_fsdp2_ranks_under_mp_spawn_have_their_steps_and_memory(tmp_path: Path) -> None:
    record, out = _run(tmp_path, "12", script="fsdp2.py")
    assert out.returncode == 0, out.stderr
    assert sorted(_results(out.stdout)) == [0, 1], out.stdout
    ranks = report_json(record)["ranks"]
    assert [(r["rank"], r["steps"]) for r in ranks] == [(0, 12), (1, 12)]  # type: ignore[union-attr]
    # Each rank's own memory (on the CPU: its heap, and its RSS).
    assert all(r["peak_allocated_bytes"] and r["peak_rss_bytes"] for r in ranks)  # type: ignore[union-attr]
