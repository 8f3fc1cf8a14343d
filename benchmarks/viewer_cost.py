"""What the viewer costs and how soon it shows new data: idle, normal and chatty jobs.

For each job the viewer runs as ``torchtop run`` would (a :class:`RunSource`, the job a child
process with the agent), headless at 80x24, in its own process. Measured inside the viewer:

- latency: from the job's timestamp to the screen refresh that first shows it, for samples (the
  agent's sample time) and for log lines (the time the job printed, carried in the line);
- CPU: the viewer process's own CPU time (all its threads, not the job's) over ``--seconds``,
  as a share of one core (psutil).

Jobs: ``idle`` sleeps; ``normal`` steps every 50 ms and prints a line a second; ``chatty`` prints
a line every 10 ms and steps every 5 ms with op windows on. The baseline, measured in the same
run on the same (possibly loaded) machine: a bare Textual app with one static widget, and with
``--baseline REV`` the viewer of an older commit (``git archive``) against the same jobs.

    python -m benchmarks.viewer_cost                   # about 3 x 25 s
    python -m benchmarks.viewer_cost --seconds 10 --baseline main~3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
JOBS = ("idle", "normal", "chatty")
#: Seconds the viewer runs before the measurement starts (start-up, the agent's history).
WARMUP_S = 4.0
#: Marks a log line's print time in its text: ``@t=1700000000.123456``.
STAMP = "@t="


# -- the jobs ------------------------------------------------------------------------------------


def job(kind: str) -> None:
    """Run one kind of job until killed (the viewer stops it)."""
    import torch

    import torchtop

    if kind == "idle":
        while True:
            time.sleep(1.0)

    x = torch.randn(64, 64)
    step_s, line_s = (0.05, 1.0) if kind == "normal" else (0.005, 0.01)
    next_line = time.time()
    while True:
        x = (x @ x).tanh()
        torchtop.step()
        now = time.time()
        if now >= next_line:
            print(f"step loss {float(x.mean()):.4f} {STAMP}{now:.6f}", flush=True)
            next_line = now + line_s
        time.sleep(step_s)


# -- the viewer, measured from inside --------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def viewer(kind: str, seconds: float, out: Path) -> None:
    """Run the viewer on a ``kind`` job (or a bare Textual app), write its numbers to ``out``."""
    from textual.app import App, ComposeResult
    from textual.widgets import Static

    process = psutil.Process()
    result: dict[str, Any] = {}

    def start_measuring() -> None:
        result["cpu0"] = sum(process.cpu_times()[:2])
        result["wall0"] = time.monotonic()

    def stop_measuring() -> None:
        result["cpu_share"] = (sum(process.cpu_times()[:2]) - result["cpu0"]) / (
            time.monotonic() - result["wall0"]
        )

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
    from torchtop.runner import RunSpec
    from torchtop.tui.app import TorchtopApp
    from torchtop.tui.sources import RunSource

    samples: list[float] = []
    lines: list[float] = []

    class Measured(TorchtopApp):
        CSS_PATH = str(Path(torchtop.tui.app.__file__).with_name("app.tcss"))
        measuring = False

        def on_mount(self) -> None:
            super().on_mount()
            self.set_timer(WARMUP_S, self.begin)
            self.set_timer(WARMUP_S + seconds, self.done)

        def begin(self) -> None:
            self.measuring = True
            result["frames0"] = getattr(self, "frames", 0)
            result["samples0"] = self.state.samples
            start_measuring()

        def done(self) -> None:
            stop_measuring()
            self.measuring = False
            result["samples"] = self.state.samples - result["samples0"]
            if hasattr(self, "frames"):  # an older viewer drew a frame every tick
                result["frames"] = self.frames - result["frames0"]
            source.stop_job()
            self.exit(0)

        def drain(self) -> None:
            if not self.measuring:
                super().drain()
                return
            shown: list[tuple[list[float], float]] = []
            for message in list(self._pending):  # what this frame applies (a C-level copy)
                if isinstance(message, Sample):
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

    spec = RunSpec(target=["-m", "benchmarks.viewer_cost", "--job", kind])
    source = RunSource(spec)
    Measured(source).run(headless=True, size=(80, 24))
    source.wait_after_viewer()
    for name, values in (("sample", samples), ("log", lines)):
        result[f"{name}_n"] = len(values)
        for q in (0.5, 0.95):
            value = percentile(values, q)
            result[f"{name}_p{round(q * 100)}_ms"] = None if value is None else value * 1e3
    out.write_text(json.dumps(result))


# -- the driver ------------------------------------------------------------------------------------


def measure(kind: str, seconds: float, pythonpath: str | None) -> dict[str, Any]:
    """One viewer process on one job; its numbers."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, str(REPO)])
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        command = [sys.executable, "-m", "benchmarks.viewer_cost", "--viewer", kind]
        command += ["--seconds", str(seconds), "--out", str(out)]
        subprocess.run(
            command, cwd=REPO, env=env, check=True, stdin=subprocess.DEVNULL, timeout=seconds + 60
        )
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def old_tree(rev: str, folder: Path) -> str:
    """The ``torchtop`` package as of ``rev``, unpacked into ``folder``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "torchtop"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return str(folder)


def fmt(value: float | None, unit: str = "") -> str:
    return "—" if value is None else f"{value:.1f}{unit}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--jobs", default=",".join(JOBS))
    parser.add_argument("--baseline", metavar="REV", help="also measure this commit's viewer")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--viewer", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job(args.job)
        return
    if args.viewer:
        viewer(args.viewer, args.seconds, args.out)
        return
    load = os.getloadavg()[0]
    cores = os.cpu_count()
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as folder:
        old = old_tree(args.baseline, Path(folder)) if args.baseline else None
        rows["bare textual app"] = measure("bare", args.seconds, None)
        for kind in args.jobs.split(","):
            rows[kind] = measure(kind, args.seconds, None)
            if old is not None:
                rows[f"{kind} ({args.baseline})"] = measure(kind, args.seconds, old)
    if args.json:
        print(json.dumps({"load": load, "cores": cores, "rows": rows}, indent=2))
        return
    bare = rows["bare textual app"]["cpu_share"]
    print(f"load average {load:.1f} on {cores} cores; {args.seconds:.0f} s per row, 80x24")
    print(
        f"{'':<22}{'CPU %core':>10}{'x bare':>8}{'frames/s':>9}"
        f"{'sample p50/p95 ms':>20}{'log p50/p95 ms':>18}"
    )
    for name, row in rows.items():
        share = row["cpu_share"]
        frames = row.get("frames")
        fps = None if frames is None else frames / args.seconds
        sample = f"{fmt(row.get('sample_p50_ms'))}/{fmt(row.get('sample_p95_ms'))}"
        log = f"{fmt(row.get('log_p50_ms'))}/{fmt(row.get('log_p95_ms'))}"
        if "sample_n" not in row:
            sample = log = ""
        ratio = share / bare if bare > 0 else None
        print(f"{name:<22}{share * 100:>10.1f}{fmt(ratio):>8}{fmt(fps):>9}{sample:>20}{log:>18}")


if __name__ == "__main__":
    main()
