"""One command that checks every CUDA and NVML path of torchtop on a real GPU.

    PYTHONPATH=. python -m benchmarks.gpu_check --out DIR      # or: make gpu-check OUT=DIR

Needs PyTorch with CUDA, nvidia-ml-py, psutil, rich and nvidia-smi; no Textual, no network, no
install step. A preflight line says for each whether it is there; the rows that need a missing
one are skipped, and say so. It runs jobs under ``torchtop run --headless --record`` (see
benchmarks/gpu_check_jobs.py) and the demos on CUDA, holds what the agent recorded against what
the job and the machine read themselves (benchmarks/gpu_check_compare.py), and prints a table:
check, expected, measured, result. Every step has a timeout and one failing check does not stop
the others. The clock starts before the preflight (importing torch may take a minute): no group
starts after 5 minutes and no step runs past 5.5, so the whole check ends within 6, and the
groups it had to leave out to fit are named at the end. In ``DIR`` it
leaves four files: ``report.txt`` (the table), ``results.json``, ``fixtures.tar.gz`` (what it
read, in the format of tests/fixtures/, at most 5 MB unpacked) and ``logs.tar.gz`` (each step's
output). Exit 0 when every check passed, 1 when one failed, 2 when no CUDA device is visible.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import gpu_check_compare as cmp
from benchmarks.gpu_check_compare import Check, check

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "benchmarks" / "gpu_check_jobs.py"
#: No group starts after this many seconds, and no step runs past it by more than
#: STEP_GRACE_S: the whole run stays under 6 minutes, even when a step hangs.
DEADLINE_S = 300.0
STEP_GRACE_S = 30.0
#: The whole check, preflight and packing included, ends within this.
TOTAL_S = 360.0
#: Fixtures kept, unpacked, at most (the rest are left out and said so).
FIXTURE_BUDGET = 5 * 1024 * 1024
LOG_LIMIT = 200_000
PAUSE_TIMEOUT_S = 3.0
#: Every bundled demo, each with what it must show.
DEMOS = tuple(cmp.DIRECTIONS)
#: The demos whose directions are about memory alone: they may share the GPU.
MEMORY_DEMOS = tuple(
    d for d in DEMOS if d not in ("vectorization", "device", "dataloader", "profiling")
)


#: What the check needs on the GPU machine besides torch with CUDA: the name users install it
#: by -> the module imported.
DEPENDENCIES = {"psutil": "psutil", "rich": "rich", "nvidia-ml-py": "pynvml"}
#: The groups that cannot run without a dependency: the agent reads the host with psutil,
#: torchtop's commands print with rich. NVML's rows need nvidia-ml-py (see NVML_DEPENDENCY).
GROUP_NEEDS = {
    "allocator and NVML": ("psutil", "rich"),
    "CPU job": ("psutil", "rich"),
    "out of memory": ("psutil", "rich"),
    "op windows": ("psutil", "rich"),
    "cost": ("psutil",),
    "demos": ("psutil", "rich"),
}
NVML_DEPENDENCY = "nvidia-ml-py"


def no_cuda_reason() -> str | None:
    """Why no CUDA device is visible, at once where there is no NVIDIA device node; else asks
    PyTorch in a child process (this process never imports torch), which also says which of
    DEPENDENCIES it can import (into ENVIRONMENT["dependencies"])."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    nodes = Path("/dev/nvidiactl").exists() or Path("/dev/nvidia0").exists()
    if not nodes and shutil.which("nvidia-smi") is None:
        return "this machine has no /dev/nvidia* device and no nvidia-smi"
    probe = (
        "import importlib, importlib.metadata as m, json, platform, torch\n"
        "deps = {}\n"
        f"for name, module in {DEPENDENCIES!r}.items():\n"
        "    try:\n"
        "        importlib.import_module(module)\n"
        "        deps[name] = 'ok ' + m.version(name)\n"
        "    except Exception as exc:\n"
        "        deps[name] = f'missing ({type(exc).__name__}: {exc})'\n"
        "print(json.dumps({'cuda': torch.cuda.is_available(), "
        "'torch': torch.__version__, 'cuda_runtime': torch.version.cuda, "
        "'python': platform.python_version(), 'dependencies': deps}))"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        return "PyTorch did not answer whether CUDA is available within 120 s"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return f"PyTorch cannot be imported ({last})"
    try:
        ENVIRONMENT.update(json.loads(out.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return f"PyTorch's answer could not be read: {out.stdout.strip()[:80]!r}"
    if ENVIRONMENT.get("cuda") is not True:
        return "PyTorch sees no CUDA device (a CPU build, or no driver)"
    return None


#: What ran where: PyTorch, CUDA and Python versions, the GPU and its driver (results.json).
ENVIRONMENT: dict[str, Any] = {}


def preflight() -> tuple[list[str], dict[str, str]]:
    """One line per dependency, and the missing ones with why (from :func:`no_cuda_reason`'s
    answer)."""
    found = ENVIRONMENT.get("dependencies") or {}
    lines = [
        f"preflight: torch {ENVIRONMENT.get('torch', '?')} with CUDA "
        f"{ENVIRONMENT.get('cuda_runtime', '?')}: ok"
    ]
    missing: dict[str, str] = {}
    for name in DEPENDENCIES:
        state = str(found.get(name, "missing (not reported)"))
        if state.startswith("ok"):
            lines.append(f"preflight: {name} {state[3:]}: ok")
            continue
        missing[name] = state
        needing = [group for group, needs in GROUP_NEEDS.items() if name in needs]
        if name == NVML_DEPENDENCY:
            needing.append("the NVML rows")
        lines.append(
            f"preflight: {name}: {state}; skipped: {', '.join(needing)} "
            f"(pip install {name} to run them)"
        )
    return lines, missing


def read_gpu_environment() -> None:
    """The GPU's name, driver and memory as nvidia-smi gives them, into ENVIRONMENT."""
    fields = ("name", "driver_version", "memory.total", "uuid")
    command = ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        ENVIRONMENT["gpus"] = f"nvidia-smi failed: {exc}"
        return
    ENVIRONMENT["gpus"] = [
        dict(zip(fields, (v.strip() for v in line.split(",")), strict=False))
        for line in out.stdout.strip().splitlines()
    ]


@dataclass
class Step:
    """One command's outcome."""

    name: str
    rc: int | None
    stdout: str
    stderr: str
    seconds: float


@dataclass
class Session:
    """The work folder, the log of every step, the fixtures, and the clock."""

    work: Path
    started: float = field(default_factory=time.monotonic)
    #: Dependencies that are not there -> why (the rows that need them are skipped).
    missing: dict[str, str] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)
    fixtures: dict[str, bytes] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def left(self) -> float:
        return DEADLINE_S - (time.monotonic() - self.started)

    def env(self) -> dict[str, str]:
        runtime = self.work / "runtime"
        runtime.mkdir(mode=0o700, exist_ok=True)
        path = os.environ.get("PYTHONPATH", "")
        return {
            **os.environ,
            "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT),
            "PYTHONUNBUFFERED": "1",
            "PYTHONWARNINGS": "ignore",
            "TORCHTOP_RUNTIME_DIR": str(runtime),
            "TORCHTOP_DEMO_RESULT": "1",
            "TMPDIR": str(self.work),
        }

    def needs(self, dependency: str, name: str) -> Check | None:
        """A skip row for ``name`` when ``dependency`` is missing, else ``None``."""
        if dependency not in self.missing:
            return None
        return check(name, "runs", f"skipped: needs {dependency}, which is missing", None)

    def run(
        self,
        name: str,
        command: Sequence[str],
        timeout: float,
        env: Mapping[str, str] | None = None,
    ) -> Step:
        """Run a command with a timeout (killed with its process group past it); ``env`` is
        added to the environment."""
        timeout = max(1.0, min(timeout, self.left() + STEP_GRACE_S))
        t0 = time.monotonic()
        proc = subprocess.Popen(
            list(command),
            cwd=ROOT,
            env={**self.env(), **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            out, err = proc.communicate()
            rc = None
            err += f"\n[gpu_check: killed after {timeout:.0f} s]"
        step = Step(name, rc, out, err, time.monotonic() - t0)
        with self.lock:
            self.steps.append(step)
        return step

    def torchtop(
        self,
        name: str,
        record: Path,
        args: Sequence[str],
        timeout: float,
        env: Mapping[str, str] | None = None,
    ) -> Step:
        command = [sys.executable, "-m", "torchtop", "run", "--headless", "--record", str(record)]
        return self.run(name, [*command, *args], timeout, env)

    def keep(self, name: str, payload: Any) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload, indent=1).encode()
        with self.lock:
            self.fixtures[name] = data


def load_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def load_frames(path: Path) -> list[dict[str, Any]]:
    try:
        return cmp.read_frames(path.read_text(errors="replace"))
    except OSError:
        return []


def failed(name: str, step: Step | None, what: str = "") -> Check:
    """A row for a step that did not give what its checks need."""
    if step is None:
        return check(name, "the step runs", what or "not run", False)
    tail = (step.stderr.strip().splitlines() or [""])[-1][:80]
    return check(name, "the step runs", what or f"exit {step.rc}: {tail}", False)


# --------------------------------------------------------------------------------------------
# nvidia-smi, read beside the agent's NVML
# --------------------------------------------------------------------------------------------


class SmiPoller:
    """Reads ``nvidia-smi --query-gpu`` in a thread, as often as it answers, with the time."""

    def __init__(self) -> None:
        self.reads: list[dict[str, Any]] = []
        self.fields = list(cmp.SMI_FIELDS)
        self.error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def query(self) -> list[dict[str, Any]] | None:
        command = [
            "nvidia-smi",
            f"--query-gpu={','.join(self.fields)}",
            "--format=csv,noheader,nounits",
        ]
        try:
            out = subprocess.run(command, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as exc:
            self.error = str(exc)
            return None
        if out.returncode != 0:
            self.error = (out.stdout + out.stderr).strip()[:200]
            return None
        return cmp.parse_smi(out.stdout, self.fields)

    def first(self) -> list[dict[str, Any]] | None:
        """One read, with the fields this nvidia-smi knows."""
        rows = self.query()
        if rows is None and "memory.reserved" in self.fields:
            self.fields.remove("memory.reserved")  # an older nvidia-smi
            rows = self.query()
        return rows

    def start(self) -> None:
        self.first()
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            t0 = time.time()
            rows = self.query()
            t1 = time.time()
            if rows:
                self.reads.append({"t": (t0 + t1) / 2, "span_s": t1 - t0, "rows": rows})
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


# --------------------------------------------------------------------------------------------
# the groups of checks
# --------------------------------------------------------------------------------------------


def shown_devices(record: Path) -> list[str] | None:
    """The devices the memory view shows for a recording, as the model says (whichever of its
    names this checkout has); ``None`` when the model gives no answer."""
    from torchtop.streams.recording import read_recording

    messages = read_recording(record).messages
    for module, name in (
        ("torchtop.model.job", "JobModel"),
        ("torchtop.model", "JobModel"),
        ("torchtop.tui.state", "MonitorState"),
    ):
        try:
            cls = getattr(importlib.import_module(module), name)
            state = cls()
        except Exception:
            continue
        state.apply_all(messages)
        for attr in ("memory_devices", "shown_devices", "used_devices", "devices_in_use"):
            value = getattr(state, attr, None)
            if value is not None:
                value = value() if callable(value) else value
                return [str(getattr(d, "id", d)) for d in value]
        primary = getattr(state, "primary_device", None)
        return None if primary is None else [str(primary)]
    return None


#: Samples often, NVML often; no op windows (a profiler left open over a plateau could move
#: device memory).
ALLOCATOR_OPTIONS = ["--interval", "0.05", "--nvml-interval", "0.25", "--no-ops"]


def group_allocator(s: Session) -> list[Check]:
    """Allocator figures against the job's memory_stats(), NVML against nvidia-smi, the job's
    GPU by UUID, the devices the view shows for a CUDA job and a CPU job."""
    record, out = s.work / "allocator.ttr", s.work / "allocator.json"
    poller = SmiPoller()
    poller.start()
    try:
        step = s.torchtop(
            "allocator",
            record,
            [*ALLOCATOR_OPTIONS, str(JOBS), "allocator", str(out)],
            timeout=150,
        )
    finally:
        poller.stop()
    truth = load_json(out)
    frames = load_frames(record)
    s.keep(
        "nvml_readings_h200.json", {"gpu": cmp.of_kind(frames, "gpu"), "nvidia_smi": poller.reads}
    )
    if truth is None:
        return [failed("allocator: job", step)]
    s.keep("cuda_memory_stats_training_h200.json", dict(sorted(truth["final_stats"].items())))
    s.keep("cuda_memory_stats_plateaus_h200.json", truth["plateaus"])
    with contextlib.suppress(OSError):
        s.keep("recording_allocator_h200.ttr", record.read_bytes())
    plateaus = truth["plateaus"]
    smi_rows = poller.reads[-1]["rows"] if poller.reads else []
    nvml_rows: list[tuple[str, Callable[[], Check]]] = [
        (
            "nvml: used memory = nvidia-smi",
            lambda: cmp.nvml_memory_matches_smi(frames, poller.reads, plateaus),
        ),
        (
            "nvml: utilization = nvidia-smi",
            lambda: cmp.nvml_utilization_matches_smi(frames, poller.reads, plateaus),
        ),
        (
            "nvml: job's GPU matched by UUID",
            lambda: cmp.nvml_gpu_matched_by_uuid(frames, truth["uuid"], smi_rows),
        ),
        (
            "nvml: energy counter = the job's own read",
            lambda: cmp.nvml_energy_matches_job(frames, plateaus),
        ),
        (
            "energy: J/step = counter difference over the steps",
            lambda: cmp.energy_per_step_matches_counter(frames, _report_energy(record)),
        ),
    ]
    rows = [cmp.allocator_matches_job(frames, plateaus)]
    rows += [s.needs(NVML_DEPENDENCY, name) or row() for name, row in nvml_rows]
    rows += [
        cmp.hello_uuid(frames, truth["uuid"], smi_rows),
        cmp.shown_devices_match(_shown(record), [f"cuda:{truth['current_device']}"], "CUDA job"),
    ]
    if not poller.reads:
        rows.append(check("nvml: nvidia-smi read", "answers", poller.error or "no reads", False))
    return rows


def _report_energy(record: Path) -> dict[str, Any] | None:
    """The report's ``energy`` for a recording (``None`` from a checkout without it)."""
    try:
        from torchtop.report.job import summarize
        from torchtop.streams.recording import read_recording

        energy = summarize(read_recording(record).messages).get("energy")
    except Exception:
        return None
    return energy if isinstance(energy, dict) else None


def _shown(record: Path) -> list[str] | None:
    try:
        return shown_devices(record)
    except Exception:
        return None


def group_cpu_job(s: Session) -> list[Check]:
    """A CPU job on the GPU machine, long enough for op windows: the view shows the CPU and
    the agent never initializes CUDA in it; and a CUDA job that sees its GPU by UUID
    (``CUDA_VISIBLE_DEVICES=GPU-…``), matched to NVML's and nvidia-smi's."""
    record, out = s.work / "cpu.ttr", s.work / "cpu.json"
    with ThreadPoolExecutor(max_workers=2) as pool:
        cpu = pool.submit(s.torchtop, "cpu job", record, [str(JOBS), "cpu", str(out)], 90)
        visible = pool.submit(_visible_by_uuid, s)
        step = cpu.result()
        rows = visible.result()
    truth = load_json(out)
    if truth is None:
        return [failed("view: devices shown (CPU job)", step), *rows]
    frames = load_frames(record)
    return [
        cmp.shown_devices_match(_shown(record), ["cpu"], "CPU job on a GPU machine"),
        cmp.never_initialised_cuda(frames, truth, CPU_JOB_MIN_S),
        *rows,
    ]


#: The CPU job runs at least this long: past the first op windows by time (5 s).
CPU_JOB_MIN_S = 6.0
VISIBLE_LABEL = "CUDA_VISIBLE_DEVICES=UUID"


def _visible_by_uuid(s: Session) -> list[Check]:
    gpus = ENVIRONMENT.get("gpus")
    uuid = gpus[0].get("uuid") if isinstance(gpus, list) and gpus else None
    name = f"devices: {VISIBLE_LABEL}"
    if not uuid:
        return [check(name, "a GPU's UUID", "nvidia-smi gave no UUID", None)]
    record, out = s.work / "visible.ttr", s.work / "visible.json"
    step = s.torchtop(
        "visible by uuid",
        record,
        ["--nvml-interval", "0.25", "--no-ops", str(JOBS), "visible", str(out)],
        90,
        env={"CUDA_VISIBLE_DEVICES": uuid},
    )
    truth = load_json(out)
    if truth is None:
        return [failed(name, step)]
    frames = load_frames(record)
    smi_rows = SmiPoller().first() or []
    nvml = f"nvml: job's GPU matched by UUID ({VISIBLE_LABEL})"
    return [
        cmp.hello_uuid(frames, truth["uuid"], smi_rows, job=VISIBLE_LABEL),
        s.needs(NVML_DEPENDENCY, nvml)
        or cmp.nvml_gpu_matched_by_uuid(frames, truth["uuid"], smi_rows, job=VISIBLE_LABEL),
    ]


def _observer_fixture(truth: dict[str, Any]) -> dict[str, Any] | None:
    """The tests/fixtures/cuda_snapshot_*.json format: observer arguments, memory_stats(),
    snapshot."""
    calls = truth.get("observer") or []
    if not calls or truth.get("snapshot") is None:
        return None
    call = calls[0]
    return {
        "observer": {k: call[k] for k in ("device", "alloc", "device_total", "device_free")},
        "memory_stats": dict(sorted(call["memory_stats"].items())),
        "snapshot": truth["snapshot"],
        "requested": truth.get("requested"),
        "message": truth.get("message", ""),
    }


#: The out-of-memory runs: key -> (label, torchtop options or None for plain python, job
#: arguments). Each writes ``<key>.json`` and, under torchtop, records ``<key>.ttr``.
OOM_RUNS: dict[str, tuple[str, list[str] | None, list[str]]] = {
    "full": ("oom full (caught)", [], ["oom-full", "catch"]),
    "plain": ("oom full (plain python)", None, ["oom-full"]),
    "watched": ("oom full (torchtop)", [], ["oom-full"]),
    "paused": (
        "oom full (--pause-on-oom)",
        ["--pause-on-oom", "--pause-timeout", str(PAUSE_TIMEOUT_S)],
        ["oom-full"],
    ),
    "fragmented": ("oom fragmented", [], ["oom-fragmented"]),
    "handled": ("oom handled by cuDNN", [], ["oom-handled"]),
    "backward": ("oom in backward", [], ["oom-backward"]),
    "stream": ("oom with a free block on another stream", [], ["oom-stream"]),
    "holders": ("oom in backward, what holds it", [], ["oom-holders"]),
    "async": ("oom on cudaMallocAsync", [], ["oom-huge"]),
    "free": (
        "free under a memory fraction",
        ["--interval", "0.05", "--no-ops", "--no-oom-capture"],
        ["free"],
    ),
}
#: Environment for some of OOM_RUNS.
OOM_ENV = {"async": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}}


def group_oom(s: Session) -> list[Check]:
    """A full and a fragmented OOM (the job's own observer attached beside the agent's), the
    job's error with and without torchtop, the pause, OOMs torch handles itself, an OOM in
    backward, one with a free block on another stream, one on the cudaMallocAsync backend,
    and free memory under a memory fraction: run side by side, each under its own cap."""
    w = s.work
    source = JOBS.read_text()

    def launch(key: str) -> Step:
        label, options, (job, *rest) = OOM_RUNS[key]
        args = [str(JOBS), job, str(w / f"{key}.json"), *rest]
        if options is None:
            return s.run(label, [sys.executable, *args], 120)
        return s.torchtop(label, w / f"{key}.ttr", [*options, *args], 120, OOM_ENV.get(key))

    with ThreadPoolExecutor(max_workers=len(OOM_RUNS)) as pool:
        steps = dict(zip(OOM_RUNS, pool.map(launch, OOM_RUNS), strict=True))
    rows: list[Check] = []
    for key, fragmented in (("full", False), ("fragmented", True)):
        truth = load_json(w / f"{key}.json")
        frames = load_frames(w / f"{key}.ttr")
        if truth is None:
            rows.append(failed(f"oom {key}: job", steps[key]))
            continue
        fixture = _observer_fixture(truth)
        if fixture is not None:
            s.keep(f"cuda_snapshot_{key}_h200.json", fixture)
        rows += cmp.oom_event_checks(
            key,
            frames,
            truth,
            fragmented=fragmented,
            top_site=(JOBS.name, cmp.marker_line(source, f"{key} top site")),
        )
        if key == "full":
            rows.append(_memory_viz(s, frames))
            rows.append(cmp.published_with_second_observer(frames, truth))
    plain = (steps["plain"].rc, steps["plain"].stderr)
    for key, label in (("watched", "torchtop run"), ("paused", "--pause-on-oom")):
        rows.append(cmp.job_error_unchanged(label, plain, (steps[key].rc, steps[key].stderr)))
    rows.append(cmp.pause_timed_out(load_frames(w / "paused.ttr"), PAUSE_TIMEOUT_S))
    handled = load_json(w / "handled.json")
    if handled is None:
        rows.append(failed("oom: handled inside torch not published", steps["handled"]))
    else:
        s.keep("oom_handled_trials_h200.json", handled)
        rows.append(
            cmp.handled_ooms_not_published(load_frames(w / "handled.ttr"), handled["trials"])
        )
    for key, compare in (
        ("backward", cmp.backward_oom),
        ("stream", cmp.free_blocks_on_the_failing_stream),
        ("holders", cmp.holders_at_backward_oom),
    ):
        truth = load_json(w / f"{key}.json")
        if truth is None:
            rows.append(failed(f"oom {key}: job", steps[key]))
            continue
        s.keep(f"oom_{key}_h200.json", truth)
        rows.append(compare(load_frames(w / f"{key}.ttr"), truth))
    async_truth = load_json(w / "async.json")
    if async_truth is not None:
        s.keep("oom_cuda_malloc_async_h200.json", async_truth)
    rows.append(cmp.async_backend(steps["async"].rc, load_frames(w / "async.ttr"), async_truth))
    free = load_json(w / "free.json")
    if free is not None:
        s.keep("free_under_cap_h200.json", free)
    rows.append(
        cmp.free_under_cap_matches(load_frames(w / "free.ttr"), free and free.get("plateau"))
    )
    return rows


def _memory_viz(s: Session, frames: list[dict[str, Any]]) -> Check:
    oom = cmp.of_kind(frames, "oom")
    path = oom[0].get("snapshot_path") if oom else None
    mode = rc = None
    output = ""
    if path and Path(path).exists():
        mode = Path(path).stat().st_mode & 0o777
        step = s.run(
            "_memory_viz stats", [sys.executable, "-m", "torch.cuda._memory_viz", "stats", path], 60
        )
        rc, output = step.rc, step.stdout + step.stderr
    return cmp.snapshot_loads(path, mode, rc, output)


def group_ops(s: Session) -> list[Check]:
    record, out = s.work / "ops.ttr", s.work / "ops.json"
    step = s.torchtop("ops", record, [str(JOBS), "ops", str(out)], timeout=120)
    truth = load_json(out)
    frames = load_frames(record)
    if truth is None:
        return [failed("ops: job", step)]
    windows = {name: cmp.window_in(frames, span) for name, span in truth["phases"].items()}
    s.keep(
        "ops_window_cuda_h200.json",
        {
            "events": truth["events"],
            "ops_frames": cmp.of_kind(frames, "ops"),
            "key_averages": truth["key_averages"],
        },
    )
    queued = truth.get("queued") or {}
    queued_window = cmp.window_in(frames, queued["span"]) if queued.get("span") else None
    return [
        cmp.kernels_attributed(windows["item"], truth["key_averages"]),
        cmp.queued_kernels_counted(queued_window, queued.get("kernel_s")),
        cmp.per_step(windows["item"], "sync_points", 1.0, ".item() every step -> syncs"),
        cmp.per_step(windows["pinned"], "copies", 1.0, "one H2D copy a step -> copies"),
        cmp.per_step(windows["pinned"], "sync_points", 0.0, "pinned non_blocking -> no sync"),
        cmp.copies_kinds(windows["pinned"], windows["pageable"]),
    ]


def group_collectives(s: Session) -> list[Check]:
    """A one-rank NCCL process group under ``torchtop run``: the agent reads its flight
    recorder live; its frames are held against the job's own dump of the ring."""
    record, out = s.work / "collectives.ttr", s.work / "collectives.json"
    env = {"TORCH_NCCL_ENABLE_TIMING": "1"}
    step = s.torchtop("collectives", record, [str(JOBS), "collectives", str(out), "nccl"], 90, env)
    truth = load_json(out)
    frames = load_frames(record)
    if truth is None:
        return [failed("collectives: job", step)]
    s.keep(
        "fr_trace_nccl_h200.json",
        {"ring": truth["ring"], "collectives_frames": cmp.of_kind(frames, "collectives")},
    )
    return cmp.collectives_checks(frames, truth)


def group_demos(s: Session) -> list[Check]:
    def one(name: str) -> Check:
        if s.left() < 20:
            return check(f"demo {name}", "runs", "out of time", None)
        step = s.run(
            f"demo {name}",
            [
                sys.executable,
                "-m",
                "torchtop",
                "demo",
                name,
                "--device",
                "cuda",
                "--headless",
                "--quick",
            ],
            timeout=120,
        )
        return cmp.demo_direction(name, step.rc, step.stdout + step.stderr)

    # Demos that compare memory run three at a time; those that compare speed run alone.
    with ThreadPoolExecutor(max_workers=3) as pool:
        rows = dict(zip(MEMORY_DEMOS, pool.map(one, MEMORY_DEMOS), strict=True))
    rows.update((name, one(name)) for name in DEMOS if name not in rows)
    return [rows[name] for name in DEMOS]


def group_cost(s: Session) -> list[Check]:
    out = s.work / "overhead.json"
    step = s.run("overhead", [sys.executable, str(JOBS), "overhead", str(out)], timeout=120)
    result = load_json(out)
    rows = [cmp.overhead(result) if result else failed("cost: agent on/off, GPU step", step)]
    arms: dict[str, list[float]] = {"plain": [], "history": []}
    for i in range(2):
        for arm in arms:
            path = s.work / f"history-{arm}-{i}.json"
            s.run(
                f"history {arm}", [sys.executable, str(JOBS), "history", str(path), arm], timeout=60
            )
            got = load_json(path)
            if got is not None:
                arms[arm].append(float(got["per_alloc_s"]))
    rows.append(cmp.history_cost(arms["plain"], arms["history"]))
    return rows


#: (name, function, seconds it needs at least): run in this order.
GROUPS: list[tuple[str, Callable[[Session], list[Check]], float]] = [
    ("allocator and NVML", group_allocator, 40),
    ("CPU job", group_cpu_job, 25),
    ("out of memory", group_oom, 40),
    ("op windows", group_ops, 25),
    ("collectives", group_collectives, 20),
    ("cost", group_cost, 50),
    ("demos", group_demos, 40),
]


def run_groups(s: Session, only: set[str] | None) -> list[Check]:
    rows: list[Check] = []
    for name, fn, needs in GROUPS:
        if only and not any(word in name for word in only):
            continue
        lacking = [d for d in GROUP_NEEDS.get(name, ()) if d in s.missing]
        if lacking:
            rows.append(check(name, "runs", f"skipped: needs {', '.join(lacking)}, missing", None))
            continue
        if s.left() < needs:
            rows.append(check(name, "runs", f"not started: {max(0.0, s.left()):.0f} s left", None))
            continue
        t0 = time.monotonic()
        try:
            got = fn(s)
        except Exception as exc:  # one group's failure never stops the others
            got = [check(name, "runs", f"crashed: {exc!r}"[:120], False)]
        print(f"[{name}: {time.monotonic() - t0:.0f} s]", file=sys.stderr, flush=True)
        rows += got
    return rows


# --------------------------------------------------------------------------------------------
# packing
# --------------------------------------------------------------------------------------------


def within_budget(
    files: dict[str, bytes], budget: int = FIXTURE_BUDGET
) -> tuple[dict[str, bytes], list[str]]:
    """The fixtures that fit in ``budget`` bytes, smallest first, and the names left out."""
    kept: dict[str, bytes] = {}
    left_out = []
    used = 0
    for name, data in sorted(files.items(), key=lambda item: len(item[1])):
        if used + len(data) <= budget:
            kept[name] = data
            used += len(data)
        else:
            left_out.append(f"{name} ({len(data)} bytes)")
    return kept, left_out


def pack(path: Path, files: dict[str, bytes]) -> None:
    """A gzipped tar of ``files`` (flat, one folder), mode 0600."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(f"{path.name.split('.')[0]}/{name}")
            info.size = len(data)
            info.mode = 0o600
            info.mtime = int(time.time())
            tar.addfile(info, io.BytesIO(data))
    os.chmod(path, 0o600)


def write_outputs(out: Path, s: Session, rows: list[Check], report: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    kept, left_out = within_budget(s.fixtures)
    pack(out / "fixtures.tar.gz", kept)
    logs = {
        f"{i:02d}-{step.name.replace(' ', '_').replace('/', '_')}.log": (
            f"$ exit {step.rc} after {step.seconds:.1f} s\n--- stdout\n{step.stdout[-LOG_LIMIT:]}"
            f"\n--- stderr\n{step.stderr[-LOG_LIMIT:]}"
        ).encode()
        for i, step in enumerate(s.steps)
    }
    pack(out / "logs.tar.gz", logs)
    (out / "report.txt").write_text(report + "\n")
    payload = {
        "environment": ENVIRONMENT,
        "checks": [asdict(r) for r in rows],
        "fixtures": sorted(kept),
        "fixtures_left_out": left_out,
        "steps": [
            {"name": st.name, "rc": st.rc, "seconds": round(st.seconds, 2)} for st in s.steps
        ],
        "seconds": round(time.monotonic() - s.started, 1),
    }
    (out / "results.json").write_text(json.dumps(payload, indent=1))
    for name in ("report.txt", "results.json"):
        os.chmod(out / name, 0o600)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for the report and fixtures"
    )
    parser.add_argument(
        "--only", action="append", help="run only the groups whose name contains this (repeatable)"
    )
    args = parser.parse_args(argv)
    started = time.monotonic()  # the preflight (torch's import) counts against the deadline
    reason = no_cuda_reason()
    if reason is not None:
        print(f"gpu_check: no CUDA device is visible: {reason}; run it where one is")
        return 2
    lines, missing = preflight()
    print("\n".join(lines), flush=True)
    read_gpu_environment()
    print(f"gpu_check: {json.dumps(ENVIRONMENT)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as folder:
        s = Session(Path(folder), started=started, missing=missing)
        rows = run_groups(s, set(args.only) if args.only else None)
        report = cmp.table(rows)
        print(report, flush=True)
        write_outputs(args.out, s, rows, report)
    left_out = [r.name for r in rows if r.measured.startswith("not started")]
    if left_out:
        print(
            f"gpu_check: to end within {TOTAL_S / 60:.0f} minutes, these groups did not "
            f"start: {', '.join(left_out)}"
        )
    print(f"report, fixtures and logs in {args.out} ({time.monotonic() - started:.0f} s)")
    return 1 if any(r.failed for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
