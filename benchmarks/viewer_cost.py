"""What the viewer costs and how soon it shows new data: idle, normal and chatty jobs.

For each job the viewer runs as ``torchtop run`` would (a :class:`RunSource`, the job a child
process with the agent), headless at 80x24, in its own process. Measured inside the viewer:

- latency: from the job's timestamp to the screen refresh that first shows it, for samples that
  change a figure on screen (the agent's sample time; a sample that looks like the last waits
  for the next frame, two seconds at most, and counts in ``any_sample`` of ``--json``) and for log
  lines (the time the job printed, carried in the line);
- CPU: the viewer process's own CPU time (all its threads, not the job's) over ``--seconds``,
  as a share of one core (psutil).

``--terminal tmux``: the cost users pay, the bytes written to the terminal included: ``torchtop
run`` in a detached tmux session (its own server) at 120x40 and 80x24, for a job that sleeps and
one that prints 20 timestamped lines a second, ``--runs`` runs each; the ``torchtop run``
process's own CPU (``/proc/PID/stat``, not its job's) over ``--seconds`` after the warm-up, and
for the printing job the time from each line's timestamp to the first read of the screen
(``tmux capture-pane`` every 20 ms) that shows it. ``--jobs ''`` leaves the headless rows out:

    python -m benchmarks.viewer_cost --jobs '' --no-end-to-end --terminal tmux

Jobs: ``idle`` sleeps; ``normal`` steps every 50 ms and prints a line a second; ``chatty`` prints
a line every 10 ms and steps every 5 ms with op windows on. The baseline, measured in the same
run on the same (possibly loaded) machine: a bare Textual app with one static widget, and with
``--baseline REV`` the viewer of an older commit (``git archive``) against the same jobs.

    python -m benchmarks.viewer_cost                   # about 5 x 25 s
    python -m benchmarks.viewer_cost --seconds 60 --baseline 2f43635 --profile

End to end: ``torchtop run`` of a job printing a timestamped line every 50 ms in a real
terminal (tmux, 120x40), its screen read every 10 ms; from each line's timestamp to the first
read that shows it (``--no-end-to-end`` leaves it out; skipped without tmux).

``--profile`` adds, per job, the CPU time of each thread and of each widget's drawing (what
each frame costs and where); ``--json`` prints every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
JOBS = ("idle", "normal", "chatty")
#: Seconds the viewer runs before the measurement starts (start-up, the agent's history; for
#: a job that steps and prints, until its steps and lines are on screen as well).
WARMUP_S = 4.0
#: Marks a log line's print time in its text: ``@t=1700000000.123456``.
STAMP = "@t="


# -- the jobs ------------------------------------------------------------------------------------


def job(kind: str) -> None:
    """Run one kind of job until killed (the viewer stops it)."""
    import torch

    import torchtop

    # The viewer is this job's parent: once it is gone (killed, crashed) the job ends too, so
    # no run of the benchmark leaves a job behind.
    parent = os.getppid()
    if kind == "idle":
        while os.getppid() == parent:
            time.sleep(0.5)
        return

    x = torch.randn(64, 64)
    step_s, line_s = (0.05, 1.0) if kind == "normal" else (0.005, 0.01)
    next_line = time.time()
    while os.getppid() == parent:
        x = (x @ x).tanh()
        torchtop.step()
        now = time.time()
        if now >= next_line:
            print(f"step loss {float(x.mean()):.4f} {STAMP}{now:.6f}", flush=True)
            next_line = now + line_s
        time.sleep(step_s)


# -- where a frame's time goes ---------------------------------------------------------------------


class Profile:
    """CPU time (of the calling thread, so a busy machine does not inflate it) and calls per
    widget: the app's drain (applying messages and building what to show), Rich and Textual
    rendering of each widget's lines, and the screen's layout and compositing."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._patch()

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def add(self, key: str, seconds: float) -> None:
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds
        self.calls[key] = self.calls.get(key, 0) + 1

    def timed(self, owner: type, name: str, key: Callable[[Any], str]) -> None:
        original = getattr(owner, name)
        profile = self

        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return original(self, *args, **kwargs)
            finally:
                profile.add(key(self), time.thread_time() - start)

        setattr(owner, name, wrapper)

    def _patch(self) -> None:
        from textual.screen import Screen
        from textual.widget import Widget
        from textual.widgets import Static

        from torchtop.tui.screens import job
        from torchtop.tui.screens.job import JobScreen

        def widget(w: Any) -> str:
            return type(w).__name__ + (f"#{w.id}" if w.id else "")

        self.timed(Widget, "render_lines", lambda w: f"render {widget(w)}")
        self.timed(Static, "update", lambda w: f"update {widget(w)}")
        self.timed(Widget, "refresh", lambda w: f"refresh asked {widget(w)}")
        self.timed(Screen, "_refresh_layout", lambda _s: "screen layout")
        self.timed(Screen, "_compositor_refresh", lambda _s: "screen composite (all renders)")
        self.timed(JobScreen, "_show", lambda _a: "app _show (all panels)")

        for name in dir(job):  # each panel's show_state: what it costs to build what it shows
            panel = getattr(job, name)
            if isinstance(panel, type) and "show_state" in panel.__dict__:
                self.timed(panel, "show_state", lambda w: f"show_state {widget(w)}")
        self.timed(JobScreen, "drain", lambda _a: "app drain (apply + _show)")

    def report(self) -> list[tuple[str, int, float]]:
        """(what, calls, milliseconds), the costliest first."""
        rows = [(k, self.calls[k], self.seconds[k] * 1e3) for k in self.seconds]
        return sorted(rows, key=lambda row: -row[2])


# -- the viewer, measured from inside --------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def viewer(kind: str, seconds: float, out: Path, profiled: bool = False) -> None:
    """Run the viewer on a ``kind`` job (or a bare Textual app), write its numbers to ``out``."""
    from textual.app import App, ComposeResult
    from textual.widgets import Static

    process = psutil.Process()
    result: dict[str, Any] = {}

    threads0: dict[int, float] = {}

    def thread_times() -> dict[int, float]:
        return {t.id: t.user_time + t.system_time for t in process.threads()}

    def start_measuring() -> None:
        threads0.update(thread_times())
        result["cpu0"] = sum(process.cpu_times()[:2])
        result["wall0"] = time.monotonic()

    def stop_measuring() -> None:
        wall = time.monotonic() - result["wall0"]
        result["cpu_share"] = (sum(process.cpu_times()[:2]) - result["cpu0"]) / wall
        # Each thread's share by name: the app's loop, the feed, the job's output.
        names = {t.native_id: t.name for t in threading.enumerate()}
        shares: dict[str, float] = {}
        for tid, seconds in thread_times().items():
            name = names.get(tid, "other")
            shares[name] = shares.get(name, 0.0) + (seconds - threads0.get(tid, 0.0)) / wall
        result["threads"] = shares

    if kind == "bare":

        class Bare(App[int]):
            def compose(self) -> ComposeResult:
                yield Static("torchtop")

            def on_mount(self) -> None:
                self.set_timer(WARMUP_S, start_measuring)
                self.set_timer(WARMUP_S + seconds, self.done)

            def done(self) -> None:
                stop_measuring()
                self.exit(0)

        Bare().run(headless=True, size=(80, 24))
        out.write_text(json.dumps(result))
        return

    import torchtop.tui.app
    from torchtop.protocol import LogLine, Sample
    from torchtop.streams.runner import RunSpec
    from torchtop.streams.sources import RunSource
    from torchtop.tui.app import TorchtopApp
    from torchtop.tui.screens.job import JobScreen

    samples: list[float] = []
    lines: list[float] = []
    all_samples: list[float] = []
    waking: set[int] = set()
    profile = Profile() if profiled else None

    class MeasuredJob(JobScreen):
        measuring = False

        def on_mount(self) -> None:
            # Textual calls every class's on_mount in turn: JobScreen's starts the source
            # after this one (calling it here too would start a second job).
            self.set_timer(WARMUP_S, self.begin)

        def begin(self) -> None:
            if kind != "idle" and not (self.state.training.has_data and self.state.log_total):
                # Measured once the screen has its shape: the steps row appearing lays out
                # the whole screen again (a tenth of a second, once), not what a frame costs.
                self.set_timer(0.5, self.begin)
                return
            self.set_timer(seconds, self.done)
            self.measuring = True
            wake_filter = getattr(self, "wake_filter", None)
            if wake_filter is not None:  # an older viewer woke for every sample
                wakes = wake_filter.wakes

                def noting(message: Any) -> bool:
                    woke = wakes(message)
                    if woke and isinstance(message, Sample):
                        waking.add(id(message))
                    return woke

                wake_filter.wakes = noting
            result["frames0"] = getattr(self, "frames", 0)
            result["samples0"] = self.state.samples
            if profile is not None:
                profile.clear()
            start_measuring()

        def done(self) -> None:
            stop_measuring()
            self.measuring = False
            result["samples"] = self.state.samples - result["samples0"]
            if profile is not None:
                result["profile"] = profile.report()
            if hasattr(self, "frames"):  # an older viewer drew a frame every tick
                result["frames"] = self.frames - result["frames0"]
            source.stop_job()
            self.app.exit(0)

        def drain(self) -> None:
            if not self.measuring:
                super().drain()
                return
            shown: list[tuple[list[float], float]] = []
            filtered = hasattr(self, "wake_filter")
            for message in list(self._pending):  # what this frame applies (a C-level copy)
                if isinstance(message, Sample):
                    # Samples that change the screen, and every sample (one that changes
                    # nothing waits for the next frame, a second at most).
                    all_samples.append(time.time() - message.t)
                    if not filtered or id(message) in waking:
                        waking.discard(id(message))
                        shown.append((samples, message.t))
                elif isinstance(message, LogLine) and STAMP in message.text:
                    shown.append((lines, float(message.text.rsplit(STAMP, 1)[1])))
            super().drain()
            if shown:
                self.call_after_refresh(self.record, shown)

        def record(self, shown: list[tuple[list[float], float]]) -> None:
            now = time.time()
            for into, t in shown:
                into.append(now - t)

    class Measured(TorchtopApp):
        CSS_PATH = str(Path(torchtop.tui.app.__file__).with_name("app.tcss"))
        JOB_SCREEN = MeasuredJob

    spec = RunSpec(target=["-m", "benchmarks.viewer_cost", "--job", kind])
    source = RunSource(spec)
    try:
        Measured(source).run(headless=True, size=(80, 24))
        source.wait_after_viewer()
    finally:
        if source.job.process is not None and source.job.running():
            source.job.process.kill()  # a viewer that failed leaves no job behind
    for name, values in (("sample", samples), ("log", lines), ("any_sample", all_samples)):
        result[f"{name}_n"] = len(values)
        for q in (0.5, 0.95, 1.0):
            value = percentile(values, q)
            key = "max" if q == 1.0 else f"p{round(q * 100)}"
            result[f"{name}_{key}_ms"] = None if value is None else value * 1e3
    out.write_text(json.dumps(result))


# -- end to end, in a terminal ---------------------------------------------------------------------

#: The terminal of the end-to-end measurement, and how often its screen is read.
TMUX_SIZE = (120, 40)
TMUX_POLL_S = 0.01
#: The job of the end-to-end measurement: a timestamped line every 50 ms.
TICKER = (
    "import os, time\n"
    "parent, end = os.getppid(), time.monotonic() + 600\n"
    "while os.getppid() == parent and time.monotonic() < end:  # never outlives the viewer\n"
    f"    print('tick {STAMP}%.6f' % time.time(), flush=True)\n"
    "    time.sleep(0.05)\n"
)


def end_to_end(seconds: float) -> dict[str, Any]:
    """``torchtop run`` of a job printing a timestamped line every 50 ms, in a real terminal
    (tmux, 120x40), its screen read every 10 ms: from each line's timestamp to the first read
    of the screen that shows it (what a user sees, the terminal's drawing included)."""
    if shutil.which("tmux") is None:
        return {"skipped": "tmux not found"}
    session = f"torchtop-viewer-cost-{os.getpid()}"
    width, height = TMUX_SIZE
    latencies: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        job = Path(folder) / "ticker.py"
        job.write_text(TICKER)
        command = f"{sys.executable} -m torchtop run --no-ops {job}"
        size = ["-x", str(width), "-y", str(height)]
        subprocess.run(
            ["tmux", "new-session", "-d", "-s", session, *size, "-c", str(REPO), command],
            check=True,
        )
        try:
            seen: set[str] = set()
            start = time.monotonic()
            while time.monotonic() - start < WARMUP_S + seconds:
                screen = subprocess.run(
                    ["tmux", "capture-pane", "-p", "-t", session],
                    capture_output=True,
                    text=True,
                ).stdout
                now = time.time()
                measuring = time.monotonic() - start >= WARMUP_S
                for stamp in screen.split(STAMP)[1:]:
                    value = stamp.split(maxsplit=1)[0] if stamp.strip() else ""
                    if value in seen or not value.replace(".", "").isdigit():
                        continue
                    seen.add(value)
                    if measuring:
                        latencies.append(now - float(value))
                time.sleep(TMUX_POLL_S)
        finally:
            subprocess.run(["tmux", "send-keys", "-t", session, "q"], capture_output=True)
            time.sleep(0.5)
            subprocess.run(["tmux", "send-keys", "-t", session, "s"], capture_output=True)
            time.sleep(1.0)
            subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    result: dict[str, Any] = {"log_n": len(latencies)}
    for q, key in ((0.5, "p50"), (0.95, "p95"), (1.0, "max")):
        latency = percentile(latencies, q)
        result[f"log_{key}_ms"] = None if latency is None else latency * 1e3
    return result


# -- the viewer's own CPU, in a real terminal -----------------------------------------------------

#: The terminal sizes of ``--terminal tmux``: the common default and the smallest supported.
TERMINAL_SIZES = ((120, 40), (80, 24))
#: The jobs of ``--terminal tmux``: one that sleeps and one that prints 20 timestamped lines a
#: second (each script ends with the viewer that started it, or after ten minutes).
TERMINAL_JOBS = {
    "idle": (
        "import os, time\n"
        "parent, end = os.getppid(), time.monotonic() + 600\n"
        "while os.getppid() == parent and time.monotonic() < end:\n"
        "    time.sleep(0.5)\n"
    ),
    "20 lines/s": TICKER,
}
#: How often the screen is read for the latency of the printing job.
TERMINAL_POLL_S = 0.02


def _clock_ticks() -> int:
    return int(os.sysconf("SC_CLK_TCK"))


def process_cpu_s(pid: int) -> float:
    """The process's own CPU time (user + system, all its threads, not its children's)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / _clock_ticks()


def _viewer_pid(tmux: list[str], session: str) -> int | None:
    """The ``torchtop run`` process in the session's pane (the pane's shell may exec it, or
    start it as its child)."""
    pane = subprocess.run(
        [*tmux, "display-message", "-p", "-t", session, "#{pane_pid}"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not pane.isdigit():
        return None
    try:
        process = psutil.Process(int(pane))
        for candidate in (process, *process.children(recursive=True)):
            line = candidate.cmdline()
            if "torchtop" in line and "run" in line:
                return candidate.pid
    except psutil.Error:
        return None
    return None


def terminal_run(kind: str, size: tuple[int, int], seconds: float) -> dict[str, Any]:
    """``torchtop run`` of a ``kind`` job in a detached tmux session of ``size`` (its own tmux
    server): the ``torchtop run`` process's CPU over ``seconds`` after :data:`WARMUP_S`, as a
    share of one core (``/proc/PID/stat``); for the printing job also the time from each line's
    timestamp to the first read of the screen that shows it (every :data:`TERMINAL_POLL_S`)."""
    width, height = size
    result: dict[str, Any] = {}
    latencies: list[float] = []
    with tempfile.TemporaryDirectory(prefix="tt-cost-", dir="/tmp") as folder:
        env = {**os.environ, "TMUX_TMPDIR": folder, "TORCHTOP_RUNTIME_DIR": f"{folder}/run"}
        env["XDG_CONFIG_HOME"] = f"{folder}/config"  # default settings, never the user's
        tmux = ["tmux", "-S", f"{folder}/tmux"]  # its own server
        script = Path(folder) / "job.py"
        script.write_text(TERMINAL_JOBS[kind])
        command = f"{sys.executable} -m torchtop run --no-ops {script}"
        session = "cost"
        subprocess.run(
            [
                *tmux,
                "new-session",
                "-d",
                "-s",
                session,
                "-x",
                str(width),
                "-y",
                str(height),
                "-c",
                str(REPO),
                command,
            ],
            check=True,
            env=env,
        )
        try:
            pid = None
            start = time.monotonic()
            while pid is None and time.monotonic() - start < 10:
                pid = _viewer_pid(tmux, session)
                time.sleep(0.1)
            if pid is None:
                raise SystemExit("viewer_cost: no torchtop run process in the tmux session")
            time.sleep(max(0.0, WARMUP_S + 1.0 - (time.monotonic() - start)))
            cpu0, wall0 = process_cpu_s(pid), time.monotonic()
            seen: set[str] = set()
            stamped = "lines" in kind
            while time.monotonic() - wall0 < seconds:
                if not stamped:
                    time.sleep(min(0.5, seconds - (time.monotonic() - wall0)))
                    continue
                screen = subprocess.run(
                    [*tmux, "capture-pane", "-p", "-t", session],
                    capture_output=True,
                    text=True,
                    env=env,
                ).stdout
                now = time.time()
                for stamp in screen.split(STAMP)[1:]:
                    value = stamp.split(maxsplit=1)[0] if stamp.strip() else ""
                    if value in seen or not value.replace(".", "").isdigit():
                        continue
                    seen.add(value)
                    if now - float(value) < 5:  # not the lines already there at the start
                        latencies.append(now - float(value))
                time.sleep(TERMINAL_POLL_S)
            result["cpu_share"] = (process_cpu_s(pid) - cpu0) / (time.monotonic() - wall0)
        finally:
            for keys in ("q", "s"):
                subprocess.run([*tmux, "send-keys", "-t", session, keys], capture_output=True)
                time.sleep(0.5)
            time.sleep(0.5)
            subprocess.run([*tmux, "kill-server"], capture_output=True, env=env)
    if latencies:
        result["log_n"] = len(latencies)
        for q, key in ((0.5, "p50"), (0.95, "p95"), (1.0, "max")):
            result[f"log_{key}_ms"] = percentile(latencies, q) * 1e3  # type: ignore[operator]
    return result


def terminal_cost(
    seconds: float, runs: int, sizes: list[tuple[int, int]], jobs: list[str]
) -> dict[str, Any]:
    """:func:`terminal_run` ``runs`` times for each job and size, with the load average."""
    rows: dict[str, Any] = {}
    for width, height in sizes:
        for kind in jobs:
            name = f"{kind} {width}x{height}"
            rows[name] = [
                {**terminal_run(kind, (width, height), seconds), "load": os.getloadavg()[0]}
                for _ in range(runs)
            ]
    return rows


def print_terminal(rows: dict[str, Any], seconds: float) -> None:
    print(
        f"\nreal terminal (tmux): the torchtop run process's CPU, {seconds:.0f} s per run after "
        f"{WARMUP_S:.0f} s; log latency read every {TERMINAL_POLL_S * 1e3:.0f} ms"
    )
    print(f"{'':<22}{'CPU %core per run':>24}{'log p50/p95 ms per run':>32}{'load':>16}")
    for name, runs in rows.items():
        cpu = " ".join(f"{run['cpu_share'] * 100:.2f}" for run in runs)
        logs = " ".join(
            f"{fmt(run.get('log_p50_ms'), 0)}/{fmt(run.get('log_p95_ms'), 0)}"
            for run in runs
            if "log_n" in run
        )
        load = " ".join(f"{run['load']:.1f}" for run in runs)
        print(f"{name:<22}{cpu:>24}{logs:>32}{load:>16}")


# -- the driver ------------------------------------------------------------------------------------


def measure(kind: str, seconds: float, tree: Path, profiled: bool) -> dict[str, Any]:
    """One viewer process on one job, run from ``tree`` (this checkout or an older commit's
    ``torchtop`` beside this benchmark); its numbers. Whatever happens (a failure, Ctrl-C) the
    viewer and its job are gone when this returns: the job ends with its parent, and a viewer
    that outlives its time is killed."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        command = [sys.executable, "-m", "benchmarks.viewer_cost", "--viewer", kind]
        command += ["--seconds", str(seconds), "--out", str(out)]
        if profiled:
            command.append("--profile")
        # ``-m`` puts the working directory first on sys.path: ``tree``'s torchtop is imported,
        # not the one the virtual environment installs.
        viewer = subprocess.Popen(command, cwd=tree, stdin=subprocess.DEVNULL)
        try:
            code = viewer.wait(timeout=seconds + WARMUP_S + 60)
        finally:
            if viewer.poll() is None:
                viewer.kill()
                viewer.wait()
        if code != 0:
            raise SystemExit(f"viewer_cost: the viewer on the {kind} job exited with {code}")
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def old_tree(rev: str, folder: Path) -> Path:
    """The ``torchtop`` package as of ``rev`` and this benchmark, unpacked into ``folder``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "torchtop"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    shutil.copytree(REPO / "benchmarks", folder / "benchmarks")
    return folder


def fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def print_table(
    rows: dict[str, dict[str, Any]], seconds: float, load: tuple[float, ...], baseline: str | None
) -> None:
    """One row per viewer; ``x REV``: its CPU against the older viewer's on the same job."""
    cores = os.cpu_count()
    print(
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {cores} cores; "
        f"{seconds:.0f} s per row, 80x24"
    )
    versus = f"x {baseline}"[:9] if baseline else ""
    print(
        f"{'':<20}{'CPU %core':>10}{versus:>10}{'frames/s':>9}"
        f"{'sample p50/p95/max ms':>23}{'log p50/p95/max ms':>20}"
    )
    for name, row in rows.items():
        share = row["cpu_share"]
        frames = row.get("frames")
        fps = None if frames is None else frames / seconds
        cells = []
        for what in ("sample", "log"):
            if f"{what}_n" not in row:
                cells.append("")
                continue
            cells.append("/".join(fmt(row.get(f"{what}_{q}_ms"), 0) for q in ("p50", "p95", "max")))
        old = rows.get(f"{name} ({baseline})")
        ratio = fmt(share / old["cpu_share"], 2) if old and old["cpu_share"] > 0 else ""
        figures = f"{share * 100:>10.1f}{ratio:>10}{fmt(fps):>9}"
        print(f"{name:<20}{figures}{cells[0]:>23}{cells[1]:>20}")


def print_profile(name: str, row: dict[str, Any], seconds: float) -> None:
    frames = max(1, row.get("frames") or 0)
    print(f"\n{name}: {frames} frames in {seconds:.0f} s; ms per second of run, ms per frame")
    threads = sorted(row.get("threads", {}).items(), key=lambda item: -item[1])
    print("  threads: " + ", ".join(f"{n} {share * 100:.1f}%" for n, share in threads if share))
    for what, calls, ms in row.get("profile", [])[:14]:
        print(f"  {what:<44}{calls:>7} calls{ms / seconds:>8.2f} ms/s{ms / frames:>8.2f} ms/frame")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="measured per row")
    parser.add_argument("--jobs", default=",".join(JOBS))
    parser.add_argument("--baseline", metavar="REV", help="also measure this commit's viewer")
    parser.add_argument("--profile", action="store_true", help="where each frame's time goes")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--no-end-to-end",
        dest="end_to_end",
        action="store_false",
        help="leave out the measurement in a real terminal (tmux)",
    )
    parser.add_argument(
        "--terminal",
        choices=("tmux",),
        help="also measure the torchtop run process in a real terminal (idle, 20 lines/s)",
    )
    parser.add_argument("--runs", type=int, default=3, help="runs per row in the terminal")
    parser.add_argument("--sizes", default="120x40,80x24", help="terminal sizes, e.g. 120x40,80x24")
    parser.add_argument(
        "--terminal-jobs", default="idle,20", help="the terminal's jobs: idle, 20 (lines/s)"
    )
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--viewer", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job(args.job)
        return
    if args.viewer:
        viewer(args.viewer, args.seconds, args.out, args.profile)
        return
    load = os.getloadavg()
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as folder:
        old = old_tree(args.baseline, Path(folder)) if args.baseline else None
        if args.jobs:
            rows["bare textual app"] = measure("bare", args.seconds, REPO, False)
        for kind in filter(None, args.jobs.split(",")):
            rows[kind] = measure(kind, args.seconds, REPO, args.profile)
            if old is not None:
                rows[f"{kind} ({args.baseline})"] = measure(kind, args.seconds, old, False)
    terminal = end_to_end(args.seconds) if args.end_to_end else None
    real: dict[str, Any] | None = None
    if args.terminal:
        sizes = [tuple(int(n) for n in size.split("x")) for size in args.sizes.split(",")]
        jobs = [kind for kind in TERMINAL_JOBS if kind.split()[0] in args.terminal_jobs]
        real = terminal_cost(args.seconds, args.runs, sizes, jobs)  # type: ignore[arg-type]
    if args.json:
        report = {"load": load, "cores": os.cpu_count(), "rows": rows, "end_to_end": terminal}
        report["terminal"] = real
        print(json.dumps(report, indent=2))
        return
    if rows:
        print_table(rows, args.seconds, load, args.baseline)
    if terminal is not None:
        if "skipped" in terminal:
            print(f"end to end: skipped ({terminal['skipped']})")
        else:
            figures = "/".join(fmt(terminal[f"log_{q}_ms"], 0) for q in ("p50", "p95", "max"))
            print(
                f"end to end in tmux {TMUX_SIZE[0]}x{TMUX_SIZE[1]}, a line every 50 ms, the "
                f"screen read every {TMUX_POLL_S * 1e3:.0f} ms: log p50/p95/max {figures} ms "
                f"({terminal['log_n']} lines)"
            )
    if real is not None:
        print_terminal(real, args.seconds)
    if args.profile:
        for name, row in rows.items():
            if "profile" in row:
                print_profile(name, row, args.seconds)


if __name__ == "__main__":
    main()
