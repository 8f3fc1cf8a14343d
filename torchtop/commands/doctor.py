"""``torchtop doctor``: what torchtop can and cannot see on this machine, and why.

One line per probe, each with the fix when something is missing. Nothing here may raise: a
probe that fails is a line that says so. torch is imported only in a child process with a
timeout, in parallel with the other probes, since a broken CUDA install can hang the import.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from torchtop import __version__
from torchtop.commands.core import VERB_HELP, Subparsers, positive_float
from torchtop.text import printable

Status = Literal["ok", "info", "warn", "missing"]

#: How long ``import torch`` (and the CUDA query after it) may take in the child by default.
TORCH_TIMEOUT_S = 30.0

# Run in a child as ``python -c``, from "/" so a ``torch/`` folder in the user's cwd is not it.
_TORCH_PROBE = r"""
import json, sys
out = {}
import torch
out["version"] = torch.__version__
out["cuda"] = torch.version.cuda
out["hip"] = getattr(torch.version, "hip", None)
out["initialized_at_import"] = bool(torch.cuda.is_initialized())
try:
    count = torch.cuda.device_count()
    devices = []
    for index in range(count):
        props = torch.cuda.get_device_properties(index)
        devices.append({"name": props.name, "uuid": str(getattr(props, "uuid", "") or "") or None,
                        "total": int(props.total_memory)})
    out["devices"] = devices
except Exception as exc:
    out["devices"] = []
    out["cuda_error"] = f"{type(exc).__name__}: {exc}"
try:
    import torch.distributed as dist
    out["distributed"] = bool(dist.is_available())
    out["backends"] = {name: bool(getattr(dist, f"is_{name}_available", lambda: False)())
                       for name in ("gloo", "nccl", "mpi")} if dist.is_available() else {}
except Exception as exc:
    out["distributed"] = False
    out["backends"] = {}
print("TORCHTOP-DOCTOR " + json.dumps(out), flush=True)
"""


@dataclass(frozen=True)
class Check:
    """One line of the report: what was looked at, what was found, and the fix if any."""

    name: str
    status: Status
    detail: str
    fix: str | None = None


@dataclass
class Machine:
    """Where the probes look; tests replace any part of it."""

    python: str = sys.executable
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    proc: Path = Path("/proc")
    which: Callable[[str], str | None] = shutil.which
    find_spec: Callable[[str], object | None] = importlib.util.find_spec
    nvml: Callable[[], Any] | None = None  # an NvmlBackend factory; None: the real one
    terminal_size: Callable[[], os.terminal_size | None] | None = None
    stdout_isatty: Callable[[], bool] = field(default_factory=lambda: sys.stdout.isatty)
    torch_timeout_s: float = TORCH_TIMEOUT_S
    #: Why gdb cannot call into a process here (None: it can); None: try it for real.
    gdb_call: Callable[[], str | None] | None = None


# -- torch, in a child ---------------------------------------------------------------------------


class _TorchChild:
    """``import torch`` and what it sees, in a child started at once and read at the end."""

    def __init__(self, machine: Machine) -> None:
        self.machine = machine
        self.started = time.monotonic()
        env = dict(machine.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.error: str | None = None
        self.proc: subprocess.Popen[str] | None = None
        try:
            self.proc = subprocess.Popen(
                [machine.python, "-c", _TORCH_PROBE],
                cwd="/",
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                errors="replace",
                start_new_session=True,
            )
        except OSError as exc:
            self.error = f"cannot start {machine.python}: {exc.strerror}"

    def result(self) -> tuple[dict[str, Any] | None, str | None]:
        """What the child found, or why there is nothing."""
        if self.proc is None:
            return None, self.error
        left = max(0.0, self.machine.torch_timeout_s - (time.monotonic() - self.started))
        try:
            out, err = self.proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate()
            return None, "timeout"
        for line in out.splitlines():
            if line.startswith("TORCHTOP-DOCTOR "):
                with contextlib.suppress(ValueError):
                    found = json.loads(line.removeprefix("TORCHTOP-DOCTOR "))
                    if isinstance(found, dict):
                        return found, None
        lines = [line for line in err.strip().splitlines() if line.strip()]
        return None, lines[-1] if lines else f"the child exited {self.proc.returncode}"


def _torch_checks(found: dict[str, Any] | None, error: str | None, machine: Machine) -> list[Check]:
    if found is None:
        if error == "timeout":
            seconds = f"{machine.torch_timeout_s:g}"
            return [
                Check(
                    "torch",
                    "missing",
                    f"`import torch` did not finish in {seconds} s (a broken CUDA or driver "
                    "install can hang it)",
                    f"run `{machine.python} -c 'import torch'` to see where it stops; "
                    "`torchtop doctor --timeout 120` waits longer",
                )
            ]
        if error and "No module named 'torch'" in error:
            return [
                Check(
                    "torch",
                    "missing",
                    f"not installed for {machine.python}",
                    "install PyTorch into this environment (https://pytorch.org/get-started)",
                )
            ]
        return [
            Check(
                "torch",
                "missing",
                f"`import torch` failed: {_visible(error or 'no output')}",
                f"run `{machine.python} -c 'import torch'` and fix what it reports",
            )
        ]
    version = _visible(str(found.get("version")))
    if found.get("cuda"):
        build = f"CUDA {_visible(str(found['cuda']))} build"
    elif found.get("hip"):
        build = f"ROCm {_visible(str(found['hip']))} build"
    else:
        build = "CPU build"
    checks = [Check("torch", "ok", f"{version}, {build}")]
    devices = found.get("devices") or []
    if devices:
        names = ", ".join(
            f"cuda:{i} {_visible(str(d.get('name')))} ({_gib(d.get('total'))})"
            for i, d in enumerate(devices)
        )
        checks.append(Check("cuda devices", "ok", f"{len(devices)} visible: {names}"))
    elif build == "CPU build":
        checks.append(
            Check(
                "cuda devices",
                "info",
                "none: this torch is a CPU build; jobs run on the CPU and torchtop shows the "
                "heap instead of the CUDA allocator",
                "for a GPU, install a CUDA build of torch (https://pytorch.org/get-started)",
            )
        )
    else:
        reason = found.get("cuda_error")
        detail = "none visible to torch" + (f" ({_visible(str(reason))})" if reason else "")
        visible = machine.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            detail += f"; CUDA_VISIBLE_DEVICES={_visible(visible)!s}"
        checks.append(
            Check(
                "cuda devices",
                "warn",
                detail,
                "check the driver with `nvidia-smi` and that CUDA_VISIBLE_DEVICES names GPUs "
                "that exist",
            )
        )
    if found.get("initialized_at_import"):
        checks.append(
            Check(
                "cuda at import",
                "warn",
                "CUDA was already initialised right after `import torch` (a sitecustomize, a "
                ".pth file or PYTORCH_* setting does it)",
                "find what initialises it (`python -X importtime -c 'import torch'`): a job "
                "that forks CUDA-using workers after that will fail",
            )
        )
    else:
        checks.append(Check("cuda at import", "ok", "`import torch` leaves CUDA uninitialised"))
    backends = found.get("backends") or {}
    if found.get("distributed"):
        have = ", ".join(name for name, ok in backends.items() if ok) or "none"
        torchrun = _torchrun(machine)
        detail = f"backends: {have}; torchrun: {torchrun or 'not found'}"
        fix = (
            None if torchrun else "torchrun comes with torch: use `python -m torch.distributed.run`"
        )
        checks.append(Check("distributed", "ok" if torchrun else "warn", detail, fix))
    else:
        checks.append(
            Check(
                "distributed",
                "info",
                "torch.distributed is not available in this build",
                "multi-rank jobs need a torch build with distributed support",
            )
        )
    return checks


def _torchrun(machine: Machine) -> str | None:
    beside = Path(machine.python).parent / "torchrun"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return machine.which("torchrun")


# -- the probes that run here ----------------------------------------------------------------------


def _python(machine: Machine) -> Check:
    version = ".".join(str(n) for n in sys.version_info[:3])
    return Check("python", "ok", f"{version} ({_visible(machine.python)})")


def _torchtop() -> Check:
    where = Path(__file__).resolve().parents[1]
    try:
        installed = importlib.metadata.version("torchtop")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    detail = f"{__version__} ({where})"
    if installed is not None and installed != __version__:
        return Check(
            "torchtop",
            "warn",
            f"{detail}, but the installed metadata says {installed}",
            "reinstall torchtop (`pip install --force-reinstall torchtop`)",
        )
    return Check("torchtop", "ok", detail)


def _nvml(machine: Machine, torch_uuids: list[str | None]) -> Check:
    try:
        factory = machine.nvml
        if factory is None:
            from torchtop.agent.probes.nvml import PynvmlBackend

            factory = PynvmlBackend
        backend = factory()
    except Exception as exc:  # the probe must not raise, whatever NVML does
        return Check("nvml", "missing", f"cannot load NVML: {_visible(str(exc))}")
    from torchtop.agent.probes.base import ProbeUnavailable

    try:
        backend.init()
    except ProbeUnavailable as exc:
        reason = _visible(str(exc))
        if "not installed" in reason:
            return Check("nvml", "missing", reason, "pip install nvidia-ml-py")
        cost = "GPU utilisation, power, clocks and the GPU's other processes are not shown"
        if not torch_uuids and "not found" in reason:
            # No driver and no GPU: nothing is lost on this machine.
            return Check(
                "nvml", "info", f"{reason}: {cost}", "on a GPU machine, NVML comes with the driver"
            )
        return Check(
            "nvml",
            "missing",
            f"{reason}: {cost}",
            "install or load the NVIDIA driver (it ships libnvidia-ml.so.1), and check "
            "`nvidia-smi` runs for this user",
        )
    except Exception as exc:
        return Check("nvml", "missing", f"NVML failed to start: {_visible(str(exc))}")
    try:
        driver = _visible(str(backend.driver_version()))
        uuids = []
        for index in range(backend.device_count()):
            handle = backend.handle(index)
            uuids.append(_visible(str(backend.uuid(handle))))
    except Exception as exc:
        return Check("nvml", "warn", f"NVML started, then failed: {_visible(str(exc))}")
    finally:
        with contextlib.suppress(Exception):
            backend.shutdown()
    detail = f"driver {driver}, {len(uuids)} GPU{'s' if len(uuids) != 1 else ''}"
    known = [u for u in torch_uuids if u]
    if known:
        from torchtop.agent.probes.nvml import uuid_key

        listed = {uuid_key(n) for n in uuids}
        matched = [u for u in known if uuid_key(u) in listed]
        detail += f"; {len(matched)} of torch's {len(known)} matched by UUID"
        if len(matched) < len(known):
            return Check(
                "nvml",
                "warn",
                detail,
                "torch sees GPUs NVML does not list (a container or MIG setting?): memory is "
                "shown, utilisation and power are not for those",
            )
    return Check("nvml", "ok", detail)


def _runtime_dir(machine: Machine) -> Check:
    from torchtop.transport import TransportError, existing_runtime_dir, runtime_dir, user_name

    path = runtime_dir()
    try:
        found = existing_runtime_dir()
    except TransportError as exc:
        try:
            info = path.lstat()
            shown = f"{path}, owner {user_name(info.st_uid)}, mode {stat.S_IMODE(info.st_mode):o}"
        except OSError:
            shown = str(path)
        return Check("runtime dir", "missing", f"{shown}: refused", _visible(str(exc)))
    if found is None:
        return Check(
            "runtime dir", "ok", f"{path} (not created yet: the first job creates it, mode 0700)"
        )
    info = found.lstat()
    mode = stat.S_IMODE(info.st_mode)
    return Check("runtime dir", "ok", f"{found}, owner {user_name(info.st_uid)}, mode {mode:o}")


def _attach(machine: Machine, gdb_call: Callable[[], str | None]) -> Check:
    from torchtop.attach.inject import _has_cap_sys_ptrace, _ptrace_scope

    gdb = machine.which("gdb")
    scope = _ptrace_scope(machine.proc)
    privileged = _has_cap_sys_ptrace(machine.proc)
    remote_exec = sys.version_info >= (3, 14)
    how = "sys.remote_exec (Python 3.14+)" if remote_exec else f"gdb ({gdb})" if gdb else None
    scope_text = f"kernel.yama.ptrace_scope={scope}"
    if how is None:
        return Check(
            "attach",
            "missing",
            f"attach needs gdb before Python 3.14; gdb is not on PATH ({scope_text})",
            "install gdb (`apt-get install gdb`), or start jobs with `torchtop run`",
        )
    if scope >= 3:
        return Check(
            "attach",
            "missing",
            f"{scope_text}: ptrace is switched off until reboot",
            "start jobs with `torchtop run`, or `torchtop.start()` in the script",
        )
    if scope == 2 and not privileged:
        return Check(
            "attach",
            "missing",
            f"{scope_text}: only root may ptrace",
            "start jobs with `torchtop run`, or `torchtop.start()` in the script",
        )
    if scope == 1 and not privileged:
        return Check(
            "attach",
            "warn",
            f"{scope_text}: only a process's parent may ptrace it, so attach is refused",
            "`sudo sysctl kernel.yama.ptrace_scope=0`, or start jobs with `torchtop run`",
        )
    if not remote_exec:
        problem = gdb_call()
        if problem is not None:
            # The probe's line ends with its fix, after the last ": ".
            cause, _, fix = problem.rpartition(": ")
            return Check("attach", "missing", f"{cause} ({scope_text})", fix)
    return Check("attach", "ok", f"with {how}; {scope_text}")


def _exporters(machine: Machine) -> list[Check]:
    checks = []
    if machine.find_spec("prometheus_client") is None:
        checks.append(
            Check(
                "prometheus",
                "missing",
                "prometheus_client is not installed: --metrics and `torchtop export` cannot serve",
                "pip install prometheus-client",
            )
        )
    else:
        checks.append(Check("prometheus", "ok", f"prometheus_client {_dist('prometheus-client')}"))
    needed = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")
    if any(_spec(machine, name) is None for name in needed):
        checks.append(
            Check(
                "otlp",
                "info",
                "the OTLP extra is not installed: --otlp is unavailable",
                "pip install 'torchtop[otel]'",
            )
        )
    else:
        checks.append(Check("otlp", "ok", f"opentelemetry-sdk {_dist('opentelemetry-sdk')}"))
    return checks


def _spec(machine: Machine, name: str) -> object | None:
    try:
        return machine.find_spec(name)
    except (ImportError, ValueError):  # a parent package missing
        return None


def _terminal(machine: Machine) -> Check:
    term = machine.environ.get("TERM")
    colorterm = machine.environ.get("COLORTERM", "")
    if machine.terminal_size is not None:
        size = machine.terminal_size()
    else:
        try:
            size = os.get_terminal_size(sys.stdout.fileno())
        except (OSError, ValueError):
            size = None
    if colorterm.lower() in ("truecolor", "24bit"):
        colours = "truecolor"
    elif term and "256" in term:
        colours = "256 colours"
    elif term in (None, "", "dumb"):
        colours = "no colours"
    else:
        colours = "16 colours"
    shown = f"TERM={_visible(term) if term else '(unset)'}, {colours}"
    if not machine.stdout_isatty() or size is None:
        return Check(
            "terminal",
            "info",
            f"stdout is not a terminal ({shown}): the viewer needs one",
            "run the viewer in a terminal, or use --headless / `torchtop report`",
        )
    detail = f"{size.columns}x{size.lines}, {shown}"
    if size.columns < 80 or size.lines < 24:
        return Check("terminal", "warn", detail, "the viewer is laid out for 80x24 or larger")
    if term in (None, "", "dumb"):
        return Check("terminal", "warn", detail, "set TERM (e.g. xterm-256color) for the viewer")
    return Check("terminal", "ok", detail)


# -- the report --------------------------------------------------------------------------------


def collect(machine: Machine | None = None) -> list[Check]:
    """Every check, in the order shown. Never raises."""
    machine = machine or Machine()
    child = _TorchChild(machine)  # first: it takes longest, and runs while the rest do
    checks = [_python(machine), _torchtop()]
    gdb_call = _in_background(machine.gdb_call or _probe_gdb_call)
    here: list[Callable[[], list[Check]]] = [
        lambda: [_runtime_dir(machine)],
        lambda: [_attach(machine, gdb_call)],
        lambda: _exporters(machine),
        lambda: [_terminal(machine)],
    ]
    local: list[Check] = []
    for probe in here:
        local.extend(_guarded(probe))
    found, error = child.result()
    checks.extend(_guarded(lambda: _torch_checks(found, error, machine), "torch"))
    uuids = [d.get("uuid") for d in (found or {}).get("devices") or []]
    checks.extend(_guarded(lambda: [_nvml(machine, uuids)], "nvml"))
    return checks + local


def _probe_gdb_call() -> str | None:
    if sys.version_info >= (3, 14):
        return None  # attach uses sys.remote_exec there
    from torchtop.attach.inject import probe_gdb_call

    return probe_gdb_call() if shutil.which("gdb") else None


def _in_background(probe: Callable[[], str | None]) -> Callable[[], str | None]:
    """Start ``probe`` in a thread now; the returned call waits for its answer."""
    answer: list[str | None] = []

    def run() -> None:
        try:
            answer.append(probe())
        except Exception as exc:  # the probe must not raise, whatever it meets
            answer.append(f"the check failed: {type(exc).__name__}: {exc}")

    thread = threading.Thread(target=run, name="torchtop-doctor-gdb", daemon=True)
    thread.start()

    def wait() -> str | None:
        thread.join()
        return answer[0] if answer else None

    return wait


def _guarded(probe: Callable[[], list[Check]], name: str = "probe") -> list[Check]:
    try:
        return probe()
    except Exception as exc:  # a probe's own bug is a line, not a traceback
        return [
            Check(name, "warn", f"the check failed: {type(exc).__name__}: {_visible(str(exc))}")
        ]


_MARK = {"ok": "ok  ", "info": "--  ", "warn": "warn", "missing": "no  "}


def render(checks: list[Check]) -> Iterator[str]:
    width = max(len(c.name) for c in checks)
    for check in checks:
        yield f"{_MARK[check.status]}  {check.name:<{width}}  {check.detail}"
        if check.fix:
            yield f"      {'':<{width}}  fix: {check.fix}"


def to_json(checks: list[Check]) -> dict[str, Any]:
    return {"torchtop_version": __version__, "checks": [asdict(c) for c in checks]}


def main(json_output: bool = False, timeout_s: float = TORCH_TIMEOUT_S) -> int:
    checks = collect(Machine(torch_timeout_s=timeout_s))
    if json_output:
        print(json.dumps(to_json(checks), indent=2))
    else:
        for line in render(checks):
            print(line)
    return 0


# -- small helpers -------------------------------------------------------------------------------


def _visible(text: str) -> str:
    return printable(text, one_line=True)


def _gib(value: object) -> str:
    return f"{value / (1 << 30):.0f} GiB" if isinstance(value, int) else "? GiB"


def _dist(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    doctor = sub.add_parser(
        "doctor",
        help=VERB_HELP["doctor"],
        description="Check this machine for torchtop: Python, torch and its CUDA devices, NVML, "
        "the runtime directory, attach (gdb, ptrace), the exporters, the terminal and "
        "torch.distributed. One line each, with the fix for what is missing.",
    )
    doctor.add_argument(
        "--json", action="store_true", help="print JSON (for scripts and bug reports)"
    )
    doctor.add_argument(
        "--timeout",
        type=positive_float,
        default=30.0,
        metavar="SECONDS",
        help="how long `import torch` may take in the check (default 30)",
    )
    return doctor


def run(args: argparse.Namespace) -> int:
    return main(json_output=args.json, timeout_s=args.timeout)
