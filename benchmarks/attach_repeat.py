"""A job's step time around ``torchtop attach`` starting an agent in it, 20 times over, against
an identical job that nobody attaches to, side by side.

Two plain training jobs (``tests/scripts/plain_train.py``: no torchtop) run at once and time
their own steps. The benchmark lets them train, runs ``torchtop attach PID --headless --record``
on one of them once (gdb starts the agent), lets them train, attaches 19 more times (each
reuses the agent), and lets them train again. Both jobs share the machine's load, so each
part's figure is the ratio of the attached job's median step time to the control's, divided by
the same ratio before any attach: 1.0 means no change. It also gives the attached job's longest
step at the first attach (gdb's stop and the agent's start) and the agents found afterwards.

    python -m benchmarks.attach_repeat            # about two minutes
    python -m benchmarks.attach_repeat --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ATTACH = [sys.executable, "-m", "torchtop", "attach", "--headless"]
JOB = Path(__file__).resolve().parent.parent / "tests" / "scripts" / "plain_train.py"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--attaches", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=1024, help="the jobs' model width")
    args = parser.parse_args()
    part_s = 3.0 if args.quick else 15.0
    folder = Path(tempfile.mkdtemp(prefix="tt-bench-"))
    env = {**os.environ, "TORCHTOP_RUNTIME_DIR": str(folder / "run"), "PYTHONWARNINGS": "ignore"}
    stop = folder / "stop"
    jobs = []
    for name in ("attached", "control"):
        job_args = ["--stop-file", str(stop), "--times", str(folder / f"{name}.json")]
        job_args += ["--sleep", "0", "--seconds", "600", "--hidden", str(args.hidden)]
        job_args += ["--threads", "1"]  # two jobs on a shared machine: no spinning OpenMP pools
        jobs.append(
            subprocess.Popen(
                [sys.executable, str(JOB), *job_args], stdout=subprocess.PIPE, text=True, env=env
            )
        )
    for job in jobs:
        assert job.stdout is not None
        job.stdout.readline()  # training
    attached = jobs[0]

    def attach(i: int) -> bool:
        record = str(folder / f"r{i}.ttr")
        out = subprocess.run(
            [*ATTACH, str(attached.pid), "--record", record, "--duration", "1"],
            capture_output=True,
            text=True,
            env=env,
        )
        if out.returncode != 0:
            print(out.stderr.strip(), file=sys.stderr)
        return out.returncode == 0

    time.sleep(part_s)
    marks = [time.time()]
    ok = attach(0)  # starts the agent
    marks.append(time.time())
    time.sleep(part_s)
    marks.append(time.time())
    ok = ok and all(attach(i) for i in range(1, args.attaches))  # each reuses it
    marks.append(time.time())
    time.sleep(part_s)
    agents = subprocess.run(
        [sys.executable, "-m", "torchtop", "ps", "--json"], capture_output=True, text=True, env=env
    )
    stop.touch()
    for job in jobs:
        job.communicate(timeout=120)
    if not ok:
        return 1
    times = [json.loads((folder / f"{n}.json").read_text())[1:] for n in ("attached", "control")]

    def median(which: int, start: float, end: float) -> float:
        return statistics.median(d for t, d in times[which] if start <= t < end)

    def relative(start: float, end: float) -> float:
        return median(0, start, end) / median(1, start, end)

    before = relative(0, marks[0])
    result = {
        "attaches": args.attaches,
        "median_step_ms_before": round(median(0, 0, marks[0]) * 1e3, 2),
        "control_median_step_ms_before": round(median(1, 0, marks[0]) * 1e3, 2),
        "ratio_after_1_attach": round(relative(marks[1], marks[2]) / before, 3),
        "ratio_after_all_attaches": round(relative(marks[3], float("inf")) / before, 3),
        "longest_step_ms_at_first_attach": round(
            max(d for t, d in times[0] if marks[0] <= t < marks[1]) * 1e3, 1
        ),
        "agents_after": [a["pid"] for a in json.loads(agents.stdout)],
        "attached_pid": attached.pid,
        "exit_codes": [job.returncode for job in jobs],
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
