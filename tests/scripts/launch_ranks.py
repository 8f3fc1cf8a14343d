"""A launcher in the manner of torchrun: starts N ranks of train_metrics.py (each calling
torchtop.start()) with RANK, LOCAL_RANK, WORLD_SIZE and TORCHELASTIC_RUN_ID set, and waits."""

import os
import subprocess
import sys
from pathlib import Path

world, run, steps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
script = str(Path(__file__).with_name("train_metrics.py"))
ranks = [
    subprocess.Popen(
        [sys.executable, script, "--start", "--steps", str(steps + 5 * rank), "--tail", "4"],
        env={
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "TORCHELASTIC_RUN_ID": run,
        },
    )
    for rank in range(world)
]
sys.exit(max(p.wait() for p in ranks))
