"""What the live view of a multi-rank job costs: ``torchtop run torchrun ...`` with N ranks.

The view runs as ``torchtop run`` runs it (a :class:`~torchtop.streams.runner.RankRun` and the
viewer app on its :class:`~torchtop.tui.screens.run.RunScreen`, headless at 80x24) in its own
process, following N real ranks of ``tests/scripts/ddp.py`` (gloo, CPU; each step sleeps
``--sleep-ms`` so the ranks leave the CPU to the viewer) with the agent's default settings.
Measured: the viewer process's own CPU time (every thread: the ranks' feeds, the folding, the
drawing; not the job's) over ``--seconds`` once every rank has stepped, as a share of one
core (psutil).

    python -m benchmarks.run_view_cost                 # 8 ranks, about a minute
    python -m benchmarks.run_view_cost --ranks 4 --seconds 10
    python -m benchmarks.run_view_cost --ranks 64 --simulated r.ttr   # the fleet simulator

``--simulated RECORDING``: the ranks are simulated (:mod:`benchmarks.fleet`: the agent's own
server replaying a real recording per rank, in a process of its own), and the view follows them
as ``torchtop attach`` does (:class:`~torchtop.streams.runs.AttachedRun`), so scales this
machine cannot train at can be measured.
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

import psutil

REPO = Path(__file__).resolve().parent.parent
DDP = REPO / "tests" / "scripts" / "ddp.py"


def viewer(ranks: int, seconds: float, sleep_ms: float, out: Path, simulated: bool) -> None:
    """Run the view over a job of ``ranks`` ranks (real, or the fleet's in this process's
    runtime directory); write what it cost to ``out``."""
    from torchtop.streams.runner import RankRun, RunSpec
    from torchtop.streams.runs import AttachedRun, RunFold
    from torchtop.streams.sources import attach_rank
    from torchtop.transport import list_agents
    from torchtop.tui.app import TorchtopApp

    run: RunFold
    if simulated:
        run = AttachedRun(list_agents())
    else:
        run = RankRun(RunSpec(
        target=[sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={ranks}", str(DDP), "--steps", "1000000",
                "--sleep-ms", str(sleep_ms)],
        headless=False,
    ))  # fmt: skip
    app = TorchtopApp.for_run(run, "run_view_cost", open_rank=attach_rank)
    me = psutil.Process()
    result: dict[str, float] = {}

    def cpu() -> float:
        times = me.cpu_times()
        return times.user + times.system

    def by_thread() -> dict[str, float]:
        """CPU seconds so far of the app's thread and of the others (feeds, I/O) together."""
        import threading

        names = {t.native_id: t.name for t in threading.enumerate()}
        main = threading.main_thread().native_id
        seconds = {"app thread": 0.0, "other threads": 0.0}
        for thread in me.threads():
            key = "app thread" if thread.id == main else "other threads"
            seconds[key] += thread.user_time + thread.system_time
            name = "thread " + names.get(thread.id, "?")
            seconds[name] = seconds.get(name, 0.0) + thread.user_time + thread.system_time
        return seconds

    def measure() -> None:
        stepping = [j for j in run.model if j.training.total > 0]
        if len(stepping) < ranks:
            app.set_timer(0.5, measure)
            return
        began, began_cpu, began_threads = time.monotonic(), cpu(), by_thread()

        def done() -> None:
            wall = time.monotonic() - began
            threads = by_thread()
            for key, value in threads.items():
                result[key] = round(value - began_threads.get(key, 0.0), 3)
            result.update(
                ranks=ranks,
                seconds=round(wall, 2),
                cpu_s=round(cpu() - began_cpu, 3),
                core_share=round((cpu() - began_cpu) / wall, 4),
                steps=sum(j.training.total for j in run.model),
            )
            app.exit(0)

        app.set_timer(seconds, done)

    app.call_later(lambda: app.set_timer(1.0, measure))
    app.run(headless=True, size=(80, 24))
    run.stop_job()
    if isinstance(run, RankRun):
        run.finish()
    out.write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--sleep-ms", type=float, default=50.0)
    parser.add_argument("--threads", action="store_true", help="CPU seconds by thread name")
    parser.add_argument(
        "--simulated", metavar="RECORDING", type=Path, help="simulated ranks replaying it"
    )
    parser.add_argument("--viewer", metavar="OUT", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.viewer is not None:
        viewer(args.ranks, args.seconds, args.sleep_ms, args.viewer, args.simulated is not None)
        return
    out = Path(f"/tmp/run_view_cost-{time.time_ns()}.json")
    command = [sys.executable, "-m", "benchmarks.run_view_cost", "--ranks", str(args.ranks),
               "--seconds", str(args.seconds), "--sleep-ms", str(args.sleep_ms),
               "--viewer", str(out)]  # fmt: skip
    if args.simulated is None:
        subprocess.run(command, cwd=REPO, check=True, timeout=args.seconds + 600)
    else:
        with tempfile.TemporaryDirectory(prefix="fleet-", dir="/tmp") as root:
            node = Path(root) / "node0"
            fleet = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.fleet", "--from", str(args.simulated),
                 "--ranks", str(args.ranks), "--nodes", "1", "--root", root,
                 "--seconds", str(args.seconds + 600)],
                cwd=REPO,
            )  # fmt: skip
            try:
                while len(list(node.glob("*.sock"))) < args.ranks:
                    if fleet.poll() is not None:
                        raise SystemExit("the fleet simulator ended before its ranks were up")
                    time.sleep(0.2)
                env = {**os.environ, "TORCHTOP_RUNTIME_DIR": str(node)}
                command += ["--simulated", str(args.simulated)]
                subprocess.run(command, cwd=REPO, check=True, timeout=args.seconds + 600, env=env)
            finally:
                fleet.terminate()
                fleet.wait()
    result = json.loads(out.read_text())
    out.unlink()
    if args.threads:
        print(json.dumps({k: v for k, v in result.items() if k.startswith("thread ")}))
    print(
        f"view of {result['ranks']} ranks: {100 * result['core_share']:.1f}% of one core "
        f"({result['cpu_s']:.2f} s CPU over {result['seconds']:.1f} s; the ranks took "
        f"{result['steps']} steps in all); app thread {result['app thread']:.2f} s, "
        f"other threads (one feed per rank) {result['other threads']:.2f} s"
    )


if __name__ == "__main__":
    main()
