"""`torchtop doctor`: every probe is a line, on this machine and when a probe fails (no gdb,
ptrace switched off, no NVML, a runtime directory owned by someone else, an `import torch` that
hangs or breaks), never a traceback; torch is imported only in a child."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fakes.nvml import FakeNvmlBackend, uuid_of
from torchtop.commands.doctor import Check, Machine, _torch_checks, collect, render

NAMES = {
    "python",
    "torchtop",
    "torch",
    "cuda devices",
    "cuda at import",
    "distributed",
    "nvml",
    "runtime dir",
    "attach",
    "prometheus",
    "otlp",
    "terminal",
}


def _by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def _doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "torchtop", "doctor", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def test_doctor_on_this_machine_prints_every_line_and_imports_no_torch(tmp_path: Path) -> None:
    out = _doctor(env={"TORCHTOP_RUNTIME_DIR": str(tmp_path / "rt")})
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if not line.startswith(" ")]
    assert sorted(line[6:21].strip() for line in lines) == sorted(NAMES)
    # torch was imported, in the child: the torch line has its version.
    assert "ok    torch " in out.stdout
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines()}
    assert "torch" not in imported
    as_json = json.loads(_doctor("--json", env={"TORCHTOP_RUNTIME_DIR": str(tmp_path)}).stdout)
    assert {c["name"] for c in as_json["checks"]} == NAMES
    assert all(c["fix"] for c in as_json["checks"] if c["status"] == "missing")


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="3.14 attaches without gdb")
def test_no_gdb_says_to_install_it() -> None:
    attach = _by_name(collect(Machine(which=lambda name: None)))["attach"]
    assert attach.status == "missing"
    assert "gdb is not on PATH" in attach.detail and "install gdb" in (attach.fix or "")


def _proc(tmp_path: Path, scope: int, cap_eff: str = "0000000000000000") -> Path:
    (tmp_path / "sys/kernel/yama").mkdir(parents=True)
    (tmp_path / "sys/kernel/yama/ptrace_scope").write_text(f"{scope}\n")
    (tmp_path / "self").mkdir()
    (tmp_path / "self/status").write_text(f"Name:\tpython\nCapEff:\t{cap_eff}\n")
    return tmp_path


def test_ptrace_switched_off_names_the_way_that_still_works(tmp_path: Path) -> None:
    machine = Machine(proc=_proc(tmp_path, 3, cap_eff="000001ffffffffff"), which=lambda n: "/gdb")
    attach = _by_name(collect(machine))["attach"]
    assert attach.status == "missing"
    assert "ptrace_scope=3" in attach.detail and "torchtop run" in (attach.fix or "")


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="3.14 attaches without gdb")
def test_a_gdb_that_cannot_call_into_processes_is_named(tmp_path: Path) -> None:
    from tests.processes.test_attach import XSTATE_OUTPUT
    from torchtop.attach.inject import gdb_call_problem

    machine = Machine(
        proc=_proc(tmp_path, 0),
        which=lambda n: "/gdb",
        gdb_call=lambda: gdb_call_problem(XSTATE_OUTPUT),
    )
    attach = _by_name(collect(machine))["attach"]
    assert attach.status == "missing"
    assert "cannot call a function in a process" in attach.detail
    assert "torchtop run" in (attach.fix or "")


def test_ptrace_scope_1_tells_how_to_allow_it(tmp_path: Path) -> None:
    machine = Machine(proc=_proc(tmp_path, 1), which=lambda n: "/gdb")
    attach = _by_name(collect(machine))["attach"]
    assert attach.status == "warn" and "ptrace_scope=0" in (attach.fix or "")


def test_no_nvml_library_is_a_line_with_the_reason() -> None:
    nvml = _by_name(collect(Machine(nvml=FakeNvmlBackend.library_not_found)))["nvml"]
    assert nvml.status in ("info", "missing")
    assert "libnvidia-ml.so.1 not found" in nvml.detail and nvml.fix


def test_nvml_gpus_are_matched_to_torchs_by_uuid() -> None:
    fake = FakeNvmlBackend.two_h200()
    found = _torch_found(devices=[uuid_of(1), uuid_of(0)])
    from torchtop.commands.doctor import _nvml

    line = _nvml(Machine(nvml=lambda: fake), [d["uuid"] for d in found["devices"]])
    assert line.status == "ok"
    assert line.detail == "driver 580.95.05, 2 GPUs; 2 of torch's 2 matched by UUID"
    assert fake.count("shutdown") == 1
    stranger = _nvml(Machine(nvml=lambda: fake), [uuid_of(7)])
    assert stranger.status == "warn" and "0 of torch's 1 matched" in stranger.detail


def _torch_found(devices: list[str], initialized: bool = False) -> dict[str, object]:
    # The shape the child prints (see _TORCH_PROBE), as on a CUDA build with two H200s.
    return {
        "version": "2.11.0+cu130",
        "cuda": "13.0",
        "hip": None,
        "initialized_at_import": initialized,
        "devices": [
            {"name": "NVIDIA H200", "uuid": uuid, "total": 150_109_880_320} for uuid in devices
        ],
        "distributed": True,
        "backends": {"gloo": True, "nccl": True, "mpi": False},
    }


def test_a_cuda_build_shows_its_devices_and_warns_when_import_starts_cuda() -> None:
    machine = Machine(which=lambda n: None)
    checks = _by_name(_torch_checks(_torch_found([uuid_of(0)], initialized=True), None, machine))
    assert checks["torch"].detail == "2.11.0+cu130, CUDA 13.0 build"
    assert checks["cuda devices"].detail == "1 visible: cuda:0 NVIDIA H200 (140 GiB)"
    assert checks["cuda at import"].status == "warn"
    assert "gloo, nccl" in checks["distributed"].detail


def test_a_cuda_build_without_devices_says_what_to_check() -> None:
    found = {**_torch_found([]), "cuda_error": "RuntimeError: No CUDA GPUs are available"}
    machine = Machine(environ={"CUDA_VISIBLE_DEVICES": "7"}, which=lambda n: None)
    line = _by_name(_torch_checks(found, None, machine))["cuda devices"]
    assert line.status == "warn"
    assert "No CUDA GPUs are available" in line.detail and "CUDA_VISIBLE_DEVICES=7" in line.detail
    assert "nvidia-smi" in (line.fix or "")


def test_a_runtime_dir_open_to_others_is_refused_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "rt"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    monkeypatch.setenv("TORCHTOP_RUNTIME_DIR", str(shared))
    line = _by_name(collect(Machine()))["runtime dir"]
    assert line.status == "missing" and "mode 755: refused" in line.detail
    assert f"chmod 700 {shared}" in (line.fix or "")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to nobody")
def test_a_runtime_dir_owned_by_someone_else_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pwd

    theirs = tmp_path / "rt"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, pwd.getpwnam("nobody").pw_uid, -1)
    monkeypatch.setenv("TORCHTOP_RUNTIME_DIR", str(theirs))
    line = _by_name(collect(Machine()))["runtime dir"]
    assert line.status == "missing" and "owner nobody" in line.detail
    assert "not a directory owned by you" in (line.fix or "")
    assert "TORCHTOP_RUNTIME_DIR" in (line.fix or "")


def _fake_torch(tmp_path: Path, body: str) -> dict[str, str]:
    package = tmp_path / "site" / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(body)
    return {**os.environ, "PYTHONPATH": str(tmp_path / "site")}


def test_a_hanging_torch_import_is_cut_off_and_said(tmp_path: Path) -> None:
    env = _fake_torch(tmp_path, "import time\ntime.sleep(600)\n")
    started = time.monotonic()
    line = _by_name(collect(Machine(environ=env, torch_timeout_s=1.0)))["torch"]
    took = time.monotonic() - started
    assert line.status == "missing" and "did not finish in 1 s" in line.detail
    assert "--timeout" in (line.fix or "")
    assert took < 30, f"doctor waited {took:.1f} s for a 1 s timeout"


def test_a_hanging_torch_import_from_the_command_line(tmp_path: Path) -> None:
    env = _fake_torch(tmp_path, "import time\ntime.sleep(600)\n")
    out = subprocess.run(
        [sys.executable, "-m", "torchtop", "doctor", "--timeout", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0 and "Traceback" not in out.stdout + out.stderr
    assert "did not finish in 1 s" in out.stdout


def test_a_broken_torch_import_shows_its_error(tmp_path: Path) -> None:
    env = _fake_torch(
        tmp_path, "raise ImportError('libcudart.so.13: cannot open shared object file')\n"
    )
    line = _by_name(collect(Machine(environ=env)))["torch"]
    assert line.status == "missing"
    assert "libcudart.so.13: cannot open shared object file" in line.detail


def test_torch_not_installed(tmp_path: Path) -> None:
    env = _fake_torch(tmp_path, "raise ModuleNotFoundError(\"No module named 'torch'\")\n")
    line = _by_name(collect(Machine(environ=env)))["torch"]
    assert line.detail.startswith("not installed for") and "pytorch.org" in (line.fix or "")


def test_the_terminal_line_escapes_what_it_reads() -> None:
    machine = Machine(
        environ={"TERM": "xterm\x1b]0;owned\x07"},
        stdout_isatty=lambda: True,
        terminal_size=lambda: os.terminal_size((70, 20)),
    )
    line = _by_name(collect(machine))["terminal"]
    assert line.status == "warn" and line.detail.startswith("70x20")
    assert "\x1b" not in "\n".join(render([line])) and "\\x1b" in line.detail


def test_a_probe_that_raises_is_a_line() -> None:
    def broken() -> object:
        raise RuntimeError("driver said no")

    nvml = _by_name(collect(Machine(nvml=broken)))["nvml"]
    assert nvml.status == "missing" and "driver said no" in nvml.detail
