"""A job's step time before and after ``torchtop attach`` started an agent in it, 20 times over.

A plain training job (``tests/scripts/plain_train.py``: no torchtop) times its own steps. The
benchmark lets it train alone, then runs ``torchtop attach PID --headless --record`` 20 times in
a row (the first starts the agent with gdb, the rest reuse it), then lets it train on with its
agent and no viewer. It reports the median step time of each part against the part before any
attach, the longest step (the one that paid for gdb's stop and the agent's start) and the
agents found afterwards (one, in the job). An agent cannot be taken out again, so the parts run
one after the other, not interleaved: run it on a quiet machine.

    python -m benchmarks.attach_repeat            # about a minute
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
    parser.add_argument("--hidden", type=int, default=2048, help="the job's model width")
    args = parser.parse_args()
    alone_s = 3.0 if args.quick else 15.0
    folder = Path(tempfile.mkdtemp(prefix="tt-bench-"))
    env = {**os.environ, "TORCHTOP_RUNTIME_DIR": str(folder / "run"), "PYTHONWARNINGS": "ignore"}
    times_file, stop = folder / "times.json", folder / "stop"
    job_args = ["--stop-file", str(stop), "--times", str(times_file), "--sleep", "0"]
    job_args += ["--seconds", "600", "--hidden", str(args.hidden)]
    job = subprocess.Popen(
        [sys.executable, str(JOB), *job_args],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert job.stdout is not None
    job.stdout.readline()  # training
    time.sleep(alone_s)

    def attach(i: int) -> bool:
        out = subprocess.run(
            [*ATTACH, str(job.pid), "--record", str(folder / f"r{i}.ttr"), "--duration", "0.3"],
            capture_output=True,
            text=True,
            env=env,
        )
        if out.returncode != 0:
            print(out.stderr.strip(), file=sys.stderr)
        return out.returncode == 0

    marks = [time.time()]
    ok = attach(0)  # starts the agent
    marks.append(time.time())
    time.sleep(alone_s)
    marks.append(time.time())
    ok = ok and all(attach(i) for i in range(1, args.attaches))  # each reuses it
    marks.append(time.time())
    time.sleep(alone_s)
    if not ok:
        job.kill()
        return 1
    agents = subprocess.run(
        [sys.executable, "-m", "torchtop", "ps", "--json"], capture_output=True, text=True, env=env
    )
    stop.touch()
    job.communicate(timeout=120)
    times = json.loads(times_file.read_text())[1:]

    def part(start: float, end: float) -> list[float]:
        return [d for t, d in times if start <= t < end]

    alone = part(0, marks[0])
    one = part(marks[1], marks[2])  # the agent, started by the first attach
    more = part(marks[3], float("inf"))  # after all the attaches
    base = statistics.median(alone)
    result = {
        "attaches": args.attaches,
        "steps": {"alone": len(alone), "after_1": len(one), "after_all": len(more)},
        "median_step_ms_alone": round(base * 1e3, 3),
        "ratio_after_1_attach": round(statistics.median(one) / base, 3),
        "ratio_after_all_attaches": round(statistics.median(more) / base, 3),
        "ratio_all_against_1": round(statistics.median(more) / statistics.median(one), 3),
        "longest_step_ms_at_first_attach": round(max(part(marks[0], marks[1])) * 1e3, 1),
        "agents_after": [a["pid"] for a in json.loads(agents.stdout)],
        "job_pid": job.pid,
        "job_exit_code": job.returncode,
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
