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
    python -m benchmarks.run_view_cost --ranks 64 --simulated r.ttr --seconds 60   # simulated
    python -m benchmarks.run_view_cost --ranks 64 --simulated r.ttr --seconds 1800  # memory

``--simulated RECORDING``: the ranks are simulated (:mod:`benchmarks.fleet`: the agent's own
server replaying a real recording per rank, in a process of its own), and the view follows them
as ``torchtop attach`` does (:class:`~torchtop.streams.runs.AttachedRun`), so scales this
machine cannot train at can be measured. Two faults are then injected into the fleet while the
view is measured, and timed from what the view shows (its screen's state after each of its
refreshes, as the user would see it), not from the simulator's clock alone:

- a straggler (``--straggle-at`` seconds into the measurement; the rank's steps
  ``--slow`` times longer outside backward and the other ranks waiting for it inside backward,
  as in a synchronous job): the time from the moment it slowed to the moment the view's
  findings name it;
- a killed rank (``--kill-at``): the time from its process's kill to the moment its row in the
  table says ``dead``.

Also printed: how often the table was redrawn (and the longest gap between two redraws), and
the view process's RSS early and late in the measurement (``--seconds 1800``: a 30-minute run).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    from torchtop.tui.screens.run import RunScreen

REPO = Path(__file__).resolve().parent.parent
DDP = REPO / "tests" / "scripts" / "ddp.py"


def viewer(args: argparse.Namespace, out: Path) -> None:
    """Run the view over a job of ``args.ranks`` ranks (real, or the fleet's in this process's
    runtime directory); write what it cost, and what it showed when, to ``out``."""
    from torchtop.streams.runner import RankRun, RunSpec
    from torchtop.streams.runs import AttachedRun, RunFold
    from torchtop.streams.sources import attach_rank
    from torchtop.transport import list_agents
    from torchtop.tui.app import TorchtopApp
    from torchtop.tui.screens.run import RunScreen

    ranks, seconds = args.ranks, args.seconds
    simulated = args.simulated is not None
    run: RunFold
    if simulated:
        run = AttachedRun(list_agents())
    else:
        run = RankRun(RunSpec(
        target=[sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={ranks}", str(DDP), "--steps", "1000000",
                "--sleep-ms", str(args.sleep_ms)],
        headless=False,
    ))  # fmt: skip
    watch = Watch(args.straggler, args.dead)
    refresh_run = RunScreen.refresh_run

    def refresh_and_look(screen: RunScreen) -> None:
        refresh_run(screen)
        watch.look(screen)

    RunScreen.refresh_run = refresh_and_look  # type: ignore[method-assign,assignment]
    app = TorchtopApp.for_run(run, "run_view_cost", open_rank=attach_rank)
    me = psutil.Process()
    result: dict[str, object] = {}
    rss: list[tuple[float, int]] = []

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

    def inject(sig: signal.Signals, what: str) -> None:
        os.kill(args.fleet_pid, sig)
        watch.sent[what] = time.time()

    def measure() -> None:
        stepping = [j for j in run.model if j.training.total > 0]
        if len(stepping) < ranks:
            app.set_timer(0.5, measure)
            return
        began, began_cpu, began_threads = time.monotonic(), cpu(), by_thread()
        watch.began = began
        rss.append((0.0, me.memory_info().rss))
        said = [0.0]

        def read_rss() -> None:
            t, now_rss = time.monotonic() - began, me.memory_info().rss
            rss.append((t, now_rss))
            if t - said[0] >= 60.0:  # progress, for the long runs
                said[0] = t
                print(
                    f"{t:.0f} s of {seconds:.0f}: view RSS {mib(now_rss)}, "
                    f"{100 * (cpu() - began_cpu) / t:.1f}% of a core so far",
                    file=sys.__stderr__,  # Textual captures sys.stderr while it runs
                    flush=True,
                )

        app.set_interval(args.rss_every, read_rss)
        if simulated and args.straggler is not None and args.straggle_at < seconds:
            app.set_timer(args.straggle_at, lambda: inject(signal.SIGUSR1, "straggler"))
        if simulated and args.dead is not None and args.kill_at < seconds:
            app.set_timer(args.kill_at, lambda: inject(signal.SIGUSR2, "dead"))

        def done() -> None:
            wall = time.monotonic() - began
            threads = by_thread()
            for key, value in threads.items():
                result[key] = round(value - began_threads.get(key, 0.0), 3)
            rss.append((wall, me.memory_info().rss))
            draws = [t - began for t in watch.draws if t >= began]
            gaps = [b - a for a, b in itertools.pairwise(draws)]
            result.update(
                ranks=ranks,
                seconds=round(wall, 2),
                cpu_s=round(cpu() - began_cpu, 3),
                core_share=round((cpu() - began_cpu) / wall, 4),
                steps=sum(j.training.total for j in run.model),
                table_draws=len(draws),
                longest_gap_s=round(max(gaps, default=0.0), 3),
                rss=[(round(t, 1), r) for t, r in rss],
                seen=watch.seen,
                sent=watch.sent,
            )
            app.exit(0)

        app.set_timer(seconds, done)

    app.call_later(lambda: app.set_timer(1.0, measure))
    if args.profile is None:
        app.run(headless=True, size=(80, 24))
    else:  # the app's thread only, the slowest first
        import cProfile

        with cProfile.Profile() as profile:
            app.run(headless=True, size=(80, 24))
        profile.dump_stats(args.profile)
    run.stop_job()
    if isinstance(run, RankRun):
        run.finish()
    out.write_text(json.dumps(result))


class Watch:
    """What the run view shows after each of its refreshes: when its table was redrawn, when
    its findings first named the straggler, when the killed rank's row first said ``dead``
    (wall-clock times, to set against the fleet's injections)."""

    def __init__(self, straggler: int | None, dead: int | None) -> None:
        self.straggler = straggler
        self.dead = dead
        self.began = float("inf")
        self.draws: list[float] = []
        self.sent: dict[str, float] = {}
        self.seen: dict[str, float] = {}
        self._table_at = 0.0

    def look(self, screen: RunScreen) -> None:
        from rich.text import Text
        from textual.widgets import DataTable, Static

        drawn = screen._table_at
        if drawn != self._table_at:
            self._table_at = drawn
            self.draws.append(time.monotonic())
        if "straggler" in self.sent and "straggler" not in self.seen:
            shown = str(screen.query_one("#run-findings", Static).render())
            named = [f for f in screen.run_.findings if f.name == "straggler"]
            if any(f.rank == self.straggler and f.summary in shown for f in named):
                self.seen["straggler"] = time.time()
        if "dead" in self.sent and "dead" not in self.seen:
            table: DataTable[Text] = screen.query_one("#ranks", DataTable)
            column = [str(c.label) for c in table.columns.values()].index("state")
            for stream, job in screen.run_.model.jobs.items():
                rank = job.hello.rank if job.hello is not None else None
                if rank == self.dead and str(table.get_row(stream)[column]) == "dead":
                    self.seen["dead"] = time.time()


def mib(n: float) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def report(result: dict[str, Any], injected: dict[str, float], args: argparse.Namespace) -> None:
    """The figures, one line each."""
    wall = float(result["seconds"])
    print(
        f"view of {result['ranks']} {'simulated ' if args.simulated else ''}ranks at 80x24 over "
        f"{wall:.0f} s: {100 * result['core_share']:.1f}% of one core ({result['cpu_s']:.2f} s "
        f"CPU; app thread {result['app thread']:.2f} s, other threads (reading the ranks) "
        f"{result['other threads']:.2f} s; the ranks took {result['steps']} steps in all)"
    )
    print(
        f"table redrawn {result['table_draws'] / wall:.2f} times a second "
        f"({result['table_draws']} times; longest gap {result['longest_gap_s']:.2f} s)"
    )
    seen, sent = result["seen"], result["sent"]
    for name, what, at in (
        ("straggler", f"straggler (rank {args.straggler}, {args.slow}x outside backward, the "
         "others waiting for it) named", args.straggle_at),
        ("dead", f"killed rank (rank {args.dead}) shown dead", args.kill_at),
    ):  # fmt: skip
        if name not in sent:
            print(f"{what}: not injected (at {at:.0f} s, past the {wall:.0f} s measured)")
        elif name not in seen or name not in injected:
            print(f"{what}: NOT SHOWN within {wall - at:.0f} s of its injection")
        else:
            print(f"{what} {seen[name] - injected[name]:.2f} s after its injection")
    rss = [(float(t), int(r)) for t, r in result["rss"]]
    if rss:
        third = max(60.0, wall / 10)
        early = [r for t, r in rss if t <= third] or [rss[0][1]]
        late = [r for t, r in rss if t >= wall - third] or [rss[-1][1]]
        print(
            f"view RSS {mib(statistics.median(early))} early (first {third:.0f} s), "
            f"{mib(statistics.median(late))} late (last {third:.0f} s), "
            f"{mib(max(r for _, r in rss))} at most ({len(rss)} reads)"
        )


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
    parser.add_argument(
        "--straggler", type=int, help="the rank slowed (simulated; default: a middle one)"
    )
    parser.add_argument("--slow", type=float, default=1.3, help="its steps outside backward, times")
    parser.add_argument("--straggle-at", type=float, default=10.0, metavar="S")
    parser.add_argument("--dead", type=int, help="the rank killed (simulated; default: a third in)")
    parser.add_argument("--kill-at", type=float, default=40.0, metavar="S")
    parser.add_argument("--rss-every", type=float, default=5.0, metavar="S")
    parser.add_argument(
        "--profile", metavar="OUT", type=Path, help="the app thread's cProfile stats, to OUT"
    )
    parser.add_argument("--fleet-pid", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--viewer", metavar="OUT", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.simulated is not None:
        if args.straggler is None:
            args.straggler = args.ranks // 2 + 1
        if args.dead is None:
            args.dead = args.ranks // 3
        if args.straggler == args.dead or not 0 <= max(args.straggler, args.dead) < args.ranks:
            parser.error("--straggler and --dead: two different ranks below --ranks")
    if args.viewer is not None:
        viewer(args, args.viewer)
        return
    out = Path(f"/tmp/run_view_cost-{time.time_ns()}.json")
    command = [sys.executable, "-m", "benchmarks.run_view_cost", "--ranks", str(args.ranks),
               "--seconds", str(args.seconds), "--sleep-ms", str(args.sleep_ms),
               "--rss-every", str(args.rss_every), "--viewer", str(out)]  # fmt: skip
    if args.profile is not None:
        command += ["--profile", str(args.profile.resolve())]
    load = os.getloadavg()
    injected: dict[str, float] = {}
    if args.simulated is None:
        subprocess.run(command, cwd=REPO, check=True, timeout=args.seconds + 600)
    else:
        with tempfile.TemporaryDirectory(prefix="fleet-", dir="/tmp") as root:
            node = Path(root) / "node0"
            events = Path(root) / "events.json"
            fleet = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.fleet", "--from", str(args.simulated),
                 "--ranks", str(args.ranks), "--nodes", "1", "--root", root,
                 "--seconds", str(args.seconds + 600), "--synced",
                 "--straggler", str(args.straggler), "--slow", str(args.slow),
                 "--straggle-after", "1e9", "--dead", str(args.dead), "--dead-after", "1e9",
                 "--events", str(events)],
                cwd=REPO,
            )  # fmt: skip
            try:
                while len(list(node.glob("*.sock"))) < args.ranks:
                    if fleet.poll() is not None:
                        raise SystemExit("the fleet simulator ended before its ranks were up")
                    time.sleep(0.2)
                env = {**os.environ, "TORCHTOP_RUNTIME_DIR": str(node)}
                command += ["--simulated", str(args.simulated), "--fleet-pid", str(fleet.pid),
                            "--straggler", str(args.straggler), "--slow", str(args.slow),
                            "--straggle-at", str(args.straggle_at), "--dead", str(args.dead),
                            "--kill-at", str(args.kill_at)]  # fmt: skip
                subprocess.run(command, cwd=REPO, check=True, timeout=args.seconds + 600, env=env)
            finally:
                fleet.terminate()
                fleet.wait()
            if events.exists():
                injected = json.loads(events.read_text())
    result = json.loads(out.read_text())
    out.unlink()
    if args.threads:
        print(json.dumps({k: v for k, v in result.items() if k.startswith("thread ")}))
    report(result, injected, args)
    after = os.getloadavg()
    print(
        f"load average (1, 5, 15 min): {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} before, "
        f"{after[0]:.1f} {after[1]:.1f} {after[2]:.1f} after ({os.cpu_count()} cores)"
    )


if __name__ == "__main__":
    main()
