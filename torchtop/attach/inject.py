"""Start an agent in a running Python process that was started without torchtop.

The agent's start must run in the job's main thread, holding the GIL, between two bytecodes:
anywhere else it could deadlock the job (the way running code at an arbitrary debugger stop
does). So nothing of ours runs at the stop itself:

- **Python 3.14+**: ``sys.remote_exec`` (PEP 768), called from torchtop's own interpreter,
  which must be the job's Python version; CPython runs the script at its next safe point. The
  job's executable is never run: it is a file whoever started the job controls.
- **Python 3.10-3.13**: gdb attaches and sets breakpoints on the entries of C-API functions a
  running job calls all the time (``PyEval_SaveThread`` around every torch op that releases the
  GIL, ``PyEval_RestoreThread``, ``PyCallable_Check``, ``PyErr_CheckSignals``). At a function's
  entry the thread holds no allocator or interpreter lock, so there gdb copies a one-line
  payload into ``PyMem_RawMalloc`` memory and queues it with
  ``Py_AddPendingCall(PyRun_SimpleString, payload)``, then detaches: the job runs on, and its
  main thread runs the payload at its next bytecode boundary. A job in a pure-Python loop calls
  none of those functions; after a short wait gdb interrupts it and queues a no-op pending call
  (``PyCallable_Check``, as memray does) that brings the main thread to one of the breakpoints.

The payload starts a thread in the job that imports :mod:`torchtop.agent.attached` from the
job's own environment (or from ``--python-path``) and starts the agent, then writes a status
file (0600) that :func:`start_agent` waits for. Every
refusal is one line that names the fix.

Only the user who owns a job may attach to it, whatever torchtop's privileges: root attaching to
another user's job would run code that user controls (the job's environment, its imports) with
root's rights, and the job could not write its status into root's private runtime directory
anyway.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtop.private_files import open_private, user_name
from torchtop.transport import AgentInfo, ensure_runtime_dir, find_agent

#: The first Python that ``sys.remote_exec`` exists in.
REMOTE_EXEC_PYTHON = (3, 14)
#: The oldest Python torchtop's agent runs in.
OLDEST_PYTHON = (3, 10)
#: ``CAP_SYS_PTRACE``'s bit in ``/proc/PID/status`` ``CapEff``.
CAP_SYS_PTRACE = 19
#: Seconds gdb waits at the breakpoints before it wakes a pure-Python main thread, and after.
GDB_BREAKPOINT_WAIT_S = 3.0
GDB_WAKE_WAIT_S = 10.0
#: The C-API functions at whose entry gdb queues the start.
SAFE_ENTRIES = (
    "PyEval_SaveThread",
    "PyEval_RestoreThread",
    "PyCallable_Check",
    "PyErr_CheckSignals",
)
#: Seconds the job may take to start the agent once it has begun (imports on a busy machine).
STARTING_TIMEOUT_S = 120.0
#: Marks in gdb's output.
MARK_SCHEDULED = "TORCHTOP: scheduled"

RUN_INSTEAD = "start the job with `torchtop run`"
#: What gdb says when it cannot call a function in the process it attached to because it cannot
#: write back the CPU's extended register state (seen with gdb 13 on CPUs with AMX registers):
#: no injection can work with that gdb on that machine.
GDB_XSTATE_ERROR = "Couldn't write extended state status"


def gdb_call_problem(output: str) -> str | None:
    """Why gdb's ``output`` shows it cannot call into processes here, or ``None``."""
    if GDB_XSTATE_ERROR not in output:
        return None
    version = gdb_version()
    return (
        f"gdb{' ' + version if version else ''} cannot call a function in a process on this "
        "machine (\"Couldn't write extended state status\": it cannot restore the CPU's "
        "extended registers, as gdb 13 fails with AMX registers): try another gdb version, or "
        + RUN_INSTEAD
    )


def gdb_version(gdb: str = "gdb") -> str | None:
    """``13.1`` for GNU gdb 13.1; ``None`` when it does not answer."""
    try:
        out = subprocess.run([gdb, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"GNU gdb .*?(\d+\.\d+(?:\.\d+)?)", out.stdout)
    return match.group(1) if match else None


_GDB_CALL_CHECKED: list[str | None] = []


def _gdb_call_checked() -> str | None:
    """:func:`probe_gdb_call`, once per torchtop process."""
    if not _GDB_CALL_CHECKED:
        _GDB_CALL_CHECKED.append(probe_gdb_call())
    return _GDB_CALL_CHECKED[0]


def probe_gdb_call(timeout_s: float = 30.0) -> str | None:
    """Attach gdb to a throwaway sleeping Python of ours and call a function in it: why that
    fails here (in one line, with the fix), or ``None`` when gdb can inject on this machine."""
    if shutil.which("gdb") is None:
        return "gdb is not installed: install gdb, or " + RUN_INSTEAD
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.05)
        try:
            out = subprocess.run(
                ["gdb", "-batch", "-nx", "-iex=set auto-load off", "-readnever",
                 "-iex=set debuginfod enabled off", "-iex=set auto-solib-add off",
                 "-p", str(child.pid), "-ex", "call (int)getpid()"],
                capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return f"gdb did not attach to a test process within {timeout_s:g} s: " + RUN_INSTEAD
        output = out.stdout + out.stderr
    finally:
        child.kill()
        child.wait()
    if "ptrace:" in output or "Could not attach" in output:
        return _ptrace_denied(child.pid).args[0]
    problem = gdb_call_problem(output)
    if problem is not None:
        return problem
    if f"= {child.pid}" not in output:
        last = next((line for line in reversed(output.splitlines()) if line.strip()), "no output")
        return f"gdb could not call a function in a test process ({last}): " + RUN_INSTEAD
    return None


class AttachRefused(Exception):
    """The agent cannot be started in the job; the message is one line with the fix."""


#: What to do about a PID that names no process (two ``ps``: the system's and torchtop's).
CHECK_PID = "check the PID (`ps -ef` lists processes, `torchtop ps` the jobs torchtop sees)"


@dataclass(frozen=True)
class Target:
    """The process to attach to, as read from ``/proc``."""

    pid: int
    uid: int
    exe: str | None
    python: tuple[int, int] | None

    @property
    def version(self) -> str:
        return ".".join(map(str, self.python)) if self.python else "?"


@dataclass(frozen=True)
class Started:
    """An agent is running in the job: ``reused`` when it was there already."""

    info: AgentInfo
    reused: bool


def read_target(pid: int, proc: Path = Path("/proc")) -> Target:
    """The process's owner, executable and Python version, or a refusal."""
    base = proc / str(pid)
    try:
        status = (base / "status").read_text()
    except FileNotFoundError:
        raise AttachRefused(f"no process {pid} is running: {CHECK_PID}") from None
    except OSError as exc:
        raise AttachRefused(f"cannot read {base}/status: {exc.strerror}") from None
    uid_line = re.search(r"^Uid:\s+(\d+)", status, re.MULTILINE)
    uid = int(uid_line.group(1)) if uid_line else -1
    try:
        exe: str | None = os.readlink(base / "exe")
    except OSError:
        exe = None
    python = _python_version(exe, base)
    return Target(pid=pid, uid=uid, exe=exe, python=python)


def _python_version(exe: str | None, base: Path) -> tuple[int, int] | None:
    """From the executable's name (``python3.11``) or a loaded ``libpython3.11.so``."""
    pattern = re.compile(r"python(\d)\.(\d+)")
    names = [os.path.basename(exe)] if exe else []
    try:
        with open(base / "maps") as f:
            names += [line.rsplit("/", 1)[-1] for line in f if "libpython" in line]
    except OSError:
        pass
    for name in names:
        match = pattern.search(name)
        if match:
            return int(match.group(1)), int(match.group(2))
    return None


def _has_cap_sys_ptrace(proc: Path = Path("/proc")) -> bool:
    try:
        status = (proc / "self" / "status").read_text()
    except OSError:
        return False
    match = re.search(r"^CapEff:\s+([0-9a-f]+)", status, re.MULTILINE)
    return bool(match and int(match.group(1), 16) >> CAP_SYS_PTRACE & 1)


def _ptrace_scope(proc: Path = Path("/proc")) -> int:
    try:
        return int((proc / "sys/kernel/yama/ptrace_scope").read_text().strip())
    except (OSError, ValueError):
        return 0  # no Yama: classic ptrace rules


def check_ptrace(target: Target, proc: Path = Path("/proc")) -> None:
    """Refuse, with the fix, when this process may not ptrace ``target``, or when ``target``
    belongs to another user (whatever our privileges: see the module's docstring)."""
    me = os.getuid()
    if target.uid != me:
        owner = user_name(target.uid)
        raise AttachRefused(
            f"pid {target.pid} belongs to {owner}, not to you ({user_name(me)}): run "
            f"`torchtop attach {target.pid}` as {owner}"
        )
    privileged = _has_cap_sys_ptrace(proc)
    scope = _ptrace_scope(proc)
    if scope >= 3:
        raise AttachRefused(
            "ptrace is switched off on this machine (kernel.yama.ptrace_scope=3, until reboot): "
            + RUN_INSTEAD
        )
    if scope == 2 and not privileged:
        raise AttachRefused(
            "only a process with CAP_SYS_PTRACE may ptrace here (kernel.yama.ptrace_scope=2): "
            + RUN_INSTEAD
        )
    if scope == 1 and not privileged:
        raise AttachRefused(
            "the kernel lets a process ptrace only its own children "
            "(kernel.yama.ptrace_scope=1): allow it with `sudo sysctl kernel.yama.ptrace_scope=0`"
            f", or {RUN_INSTEAD}"
        )


def _ptrace_denied(pid: int) -> AttachRefused:
    return AttachRefused(
        f"cannot ptrace pid {pid} (operation not permitted): in a container, add the "
        f"CAP_SYS_PTRACE capability (`docker run --cap-add=SYS_PTRACE`), or {RUN_INSTEAD}"
    )


# -- the payload ----------------------------------------------------------------------------

_PAYLOAD = """\
import _thread
def _torchtop_attach(status, paths, options, runtime_dir):
    import json, os, sys
    os.close(os.open(status + '.began', os.O_WRONLY | os.O_CREAT, 0o600))
    added = [p for p in paths if p not in sys.path]
    sys.path.extend(added)
    try:
        try:
            from torchtop.agent.attached import start_attached
        except BaseException as exc:
            fd = os.open(status + '.tmp', os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, 'w') as f:
                json.dump({'ok': False, 'import_error': type(exc).__name__ + ': ' + str(exc),
                           'executable': sys.executable}, f)
            os.replace(status + '.tmp', status)
            return
        start_attached(status, options, runtime_dir)
    finally:
        for p in added:
            if p in sys.path:
                sys.path.remove(p)
_thread.start_new_thread(_torchtop_attach, (%r, %r, %r, %r))
"""


def payload_source(
    status_path: str, python_path: str | None, options: dict[str, Any], runtime_dir: str
) -> str:
    """The Python the job runs at its safe point: a thread of its own that imports the agent's
    entry point (from the directories of ``python_path`` too, after the job's own, and only
    while it starts) and starts it; an import that fails is written to the status file, never
    to the job's output.

    The import runs in a new thread, not in the main thread where the safe point is: the main
    thread may be halfway through importing a module, and importing from inside that would
    find it (or a module it needs) partly initialized. A thread of its own waits for the main
    thread's import to finish, as any thread does."""
    paths = [p for p in (python_path or "").split(os.pathsep) if p]
    return _PAYLOAD % (status_path, paths, options, runtime_dir)


def payload_line(source: str) -> str:
    """``source`` as one line of hex digits, quotes and letters: safe inside a C string in a gdb
    command, and run in a namespace of its own, not the job's ``__main__``."""
    return f"exec(bytes.fromhex('{source.encode().hex()}').decode(),{{}})"


# -- gdb (Python 3.10-3.13) -----------------------------------------------------------------


def gdb_script(line: str) -> str:
    """The gdb commands that queue ``line`` as a pending call at a safe point, then detach."""
    size = len(line) + 1
    # Thread 1 is the main thread: only a pending call added there wakes it (CPython sets the
    # eval breaker only when the thread that adds the call is one that may run it).
    breaks = "\n".join(f"break {name} thread 1" for name in SAFE_ENTRIES)
    return f"""\
set pagination off
set confirm off
set $scheduled = 0
sharedlibrary libpython
p "TORCHTOP: attached"
p (void*)Py_AddPendingCall
p (void*)PyRun_SimpleString
p (void*)PyMem_RawMalloc
{breaks}
commands 1-{len(SAFE_ENTRIES)}
  silent
  delete breakpoints
  set $buf = (char*)PyMem_RawMalloc({size})
  set {{char[{size}]}}$buf = "{line}"
  p (int)Py_AddPendingCall((void*)PyRun_SimpleString, $buf)
  set $scheduled = 1
  p "{MARK_SCHEDULED}"
end
continue
if $scheduled == 0
  p "TORCHTOP: waking the main thread"
  thread 1
  p (int)Py_AddPendingCall((void*)PyCallable_Check, (void*)0)
  continue
end
"""


def gdb_command(pid: int, script: Path) -> list[str]:
    """gdb's command line: no init file (``-nx``) and no auto-loaded script (the ``-gdb.py``
    files beside a job's libraries, ``.gdbinit`` in its folders), so gdb runs only ``script``."""
    return [
        "gdb",
        "-batch",
        "-nx",
        "-iex=set auto-load off",
        "-readnever",  # minimal symbols suffice: reading debug info would hold the job longer
        "-iex=set debuginfod enabled off",
        "-iex=set auto-solib-add off",  # torch's libraries' symbols would take minutes
        "-p",
        str(pid),
        f"-x={script}",
    ]


def run_gdb(
    pid: int,
    script: str,
    script_dir: Path,
    *,
    breakpoint_wait_s: float = GDB_BREAKPOINT_WAIT_S,
    wake_wait_s: float = GDB_WAKE_WAIT_S,
) -> str:
    """Run gdb on ``pid`` with ``script``; its output. Interrupted (never killed: a killed gdb
    would leave its breakpoints in the job) when the job does not come to a breakpoint."""
    path = script_dir / f"attach-{pid}-{secrets.token_hex(4)}.gdb"
    with open_private(path) as f:
        f.write(script.encode())
    try:
        proc = subprocess.Popen(
            gdb_command(pid, path),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # the user's Ctrl-C reaches us, and we detach gdb cleanly
        )
        try:
            return _wait_gdb(proc, breakpoint_wait_s, wake_wait_s)
        except BaseException:
            _interrupt_until_done(proc)
            raise
    finally:
        path.unlink(missing_ok=True)


def _wait_gdb(proc: subprocess.Popen[str], breakpoint_wait_s: float, wake_wait_s: float) -> str:
    try:
        out, _ = proc.communicate(timeout=breakpoint_wait_s + 10.0)  # + gdb's own start
        return out
    except subprocess.TimeoutExpired:
        pass
    proc.send_signal(signal.SIGINT)  # no breakpoint yet: wake the main thread
    try:
        out, _ = proc.communicate(timeout=wake_wait_s)
        return out
    except subprocess.TimeoutExpired:
        pass
    return _interrupt_until_done(proc)


def _interrupt_until_done(proc: subprocess.Popen[str]) -> str:
    """SIGINT gdb until it detaches and exits; SIGTERM (which detaches too) as a last resort."""
    for sig in (signal.SIGINT, signal.SIGINT, signal.SIGINT, signal.SIGTERM):
        if proc.poll() is not None:
            break
        proc.send_signal(sig)
        try:
            out, _ = proc.communicate(timeout=5.0)
            return out
        except subprocess.TimeoutExpired:
            continue
    out, _ = proc.communicate()
    return out


def _gdb_failure(pid: int, output: str) -> AttachRefused:
    if "ptrace:" in output or "Could not attach" in output:
        return _ptrace_denied(pid)
    if "No symbol" in output:
        return AttachRefused(
            f"pid {pid} does not expose CPython's C API to gdb (not CPython, or stripped): "
            + RUN_INSTEAD
        )
    problem = gdb_call_problem(output)
    if problem is not None:
        return AttachRefused(f"cannot start an agent in pid {pid}: {problem}")
    if "TORCHTOP: waking" in output:
        return AttachRefused(
            f"pid {pid}'s threads ran no Python for {GDB_WAKE_WAIT_S:.0f} s (all blocked in long "
            f"calls?): try again when it runs, or {RUN_INSTEAD}"
        )
    last = next((line for line in reversed(output.splitlines()) if line.strip()), "no output")
    return AttachRefused(f"gdb could not queue the agent's start in pid {pid} ({last})")


# -- Python 3.14+ -------------------------------------------------------------------------------


def remote_exec(target: Target, source: str, script_dir: Path) -> None:
    """Queue ``source`` in the job with ``sys.remote_exec``, called from this interpreter: the
    job's own executable is never run (its owner controls that file), so this Python must be
    the job's version."""
    ours = sys.version_info[:2]
    if target.python != ours or not hasattr(sys, "remote_exec"):
        raise AttachRefused(
            f"pid {target.pid} runs Python {target.version} and torchtop runs in Python "
            f"{'.'.join(map(str, ours))}: starting an agent with sys.remote_exec needs torchtop "
            f"installed in a Python {target.version} environment and run from there, or "
            + RUN_INSTEAD
        )
    path = script_dir / f"attach-{target.pid}-{secrets.token_hex(4)}.py"
    with open_private(path) as f:
        f.write(source.encode())
    try:
        sys.remote_exec(target.pid, str(path))  # type: ignore[attr-defined,unused-ignore]
    except PermissionError:
        path.unlink(missing_ok=True)
        raise _ptrace_denied(target.pid) from None
    except Exception as exc:
        path.unlink(missing_ok=True)
        raise AttachRefused(
            f"sys.remote_exec could not reach pid {target.pid} ({type(exc).__name__}: {exc}): "
            + RUN_INSTEAD
        ) from None
    # The job reads the script when it runs it: the status file says when it may go.


# -- the whole attach -----------------------------------------------------------------------


def our_python_path() -> str:
    """What ``--python-path`` should name for a job that lacks torchtop: the directories this
    torchtop and the agent's one dependency outside the standard library (psutil) come from."""
    import psutil

    import torchtop

    dirs = [str(Path(m.__file__ or "").resolve().parent.parent) for m in (torchtop, psutil)]
    return os.pathsep.join(dict.fromkeys(dirs))


def start_agent(
    pid: int,
    *,
    python_path: str | None = None,
    options: dict[str, Any] | None = None,
    start_timeout_s: float = 30.0,
    progress: Callable[[str], None] | None = None,
) -> Started:
    """An agent running in ``pid``: the one there, or one started now. Raises
    :class:`AttachRefused` with the fix when neither can be."""
    existing = find_agent(pid)
    if existing is not None:
        return Started(existing, reused=True)
    target = read_target(pid)
    check_ptrace(target)  # before the rest: another user's process hides its executable
    if target.python is None:
        raise AttachRefused(f"pid {pid} ({target.exe or 'unknown'}) is not a Python process")
    if target.python < OLDEST_PYTHON:
        raise AttachRefused(
            f"pid {pid} runs Python {target.version}; torchtop's agent needs 3.10 or newer"
        )
    use_gdb = target.python < REMOTE_EXEC_PYTHON
    if use_gdb and shutil.which("gdb") is None:
        raise AttachRefused(
            f"gdb is not installed, and starting an agent in a Python {target.version} job "
            f"needs it: install gdb (e.g. `apt install gdb`), or {RUN_INSTEAD}"
        )
    if use_gdb:
        # Tried first on a throwaway process of ours: where gdb cannot call a function and
        # restore the registers after (see gdb_call_problem), the job's own call would fail
        # inside it, with an error raised into its code.
        problem = _gdb_call_checked()
        if problem is not None:
            raise AttachRefused(f"cannot start an agent in pid {pid}: {problem}")
    directory = ensure_runtime_dir()
    status = directory / f"{pid}-attach-{secrets.token_hex(4)}.json"
    agent_options = {"capture_output": False, "stderr_notices": False, **(options or {})}
    source = payload_source(str(status), python_path, agent_options, str(directory))
    say = progress or (lambda _text: None)
    say(f"starting an agent in pid {pid} (Python {target.version})")
    if use_gdb:
        output = run_gdb(pid, gdb_script(payload_line(source)), directory)
        if MARK_SCHEDULED not in output:
            raise _gdb_failure(pid, output)
    else:
        remote_exec(target, source, directory)
    try:
        result = _wait_status(status, pid, start_timeout_s)
    finally:
        for leftover in directory.glob(f"attach-{pid}-*.py"):
            leftover.unlink(missing_ok=True)
    if not result.get("ok"):
        raise _start_failure(pid, target, result)
    info = find_agent(pid)
    if info is None:
        raise AttachRefused(f"the agent in pid {pid} started but does not listen")
    return Started(info, reused=bool(result.get("reused")))


def _wait_status(status: Path, pid: int, timeout_s: float) -> dict[str, Any]:
    """The status the job wrote. Once the job has begun the start (on a busy machine its
    imports take a while), it gets :data:`STARTING_TIMEOUT_S` more to finish."""
    began = status.with_name(status.name + ".began")
    deadline = time.monotonic() + timeout_s
    extended = False
    try:
        while time.monotonic() < deadline:
            try:
                result = json.loads(status.read_text())
            except FileNotFoundError:
                if not Path(f"/proc/{pid}").exists():
                    raise AttachRefused(f"pid {pid} ended before its agent started") from None
                if not extended and began.exists():
                    deadline, extended = time.monotonic() + STARTING_TIMEOUT_S, True
                time.sleep(0.05)
                continue
            except (OSError, ValueError):
                time.sleep(0.05)
                continue
            status.unlink(missing_ok=True)
            return result if isinstance(result, dict) else {}
    finally:
        began.unlink(missing_ok=True)
    if extended:
        raise AttachRefused(
            f"the agent in pid {pid} began to start but did not finish in "
            f"{STARTING_TIMEOUT_S:.0f} s: see `torchtop ps` in a while"
        )
    raise AttachRefused(
        f"the agent's start is queued in pid {pid}, but its main thread ran no Python for "
        f"{timeout_s:.0f} s (blocked in a long call?): it starts when that thread runs Python "
        f"again; then run `torchtop attach {pid}`"
    )


def _start_failure(pid: int, target: Target, result: dict[str, Any]) -> AttachRefused:
    if "import_error" in result:
        exe = result.get("executable") or target.exe or "its Python"
        return AttachRefused(
            f"pid {pid}'s Python ({exe}) cannot import torchtop ({result['import_error']}): "
            f"give --python-path {our_python_path()}, install torchtop in the job's environment, "
            f"or {RUN_INSTEAD}"
        )
    return AttachRefused(f"the agent could not start in pid {pid}: {result.get('error')}")
