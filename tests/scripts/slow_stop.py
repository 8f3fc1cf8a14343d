"""A job that takes its time to stop: on Ctrl-C it saves a checkpoint for SECONDS seconds.

``slow_stop.py SECONDS [--ignore-sigint]``: steps until interrupted, then writes
``checkpoint saved`` to stdout after SECONDS seconds and exits 0. With ``--ignore-sigint`` it
ignores SIGINT altogether and only SIGTERM or SIGKILL stops it.
"""

import signal
import sys
import time

import torchtop

seconds = float(sys.argv[1])
if "--ignore-sigint" in sys.argv:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
try:
    step = 0
    while True:
        time.sleep(0.02)
        torchtop.step()
        step += 1
        if step % 50 == 0:
            print(f"step {step}", flush=True)
except KeyboardInterrupt:
    print("saving a checkpoint", flush=True)
    time.sleep(seconds)
    print("checkpoint saved", flush=True)
