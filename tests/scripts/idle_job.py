"""A job that does no training and never imports torch: it sleeps until its time is up.

``idle_job.py SECONDS [--thread] [--churn]``: with ``--thread`` the main script returns at once
and a non-daemon thread counts steps (``torchtop.step()``) for SECONDS, printing when main
returned; with ``--churn`` each step holds a buffer of another size (written, so its pages are
in the RSS), so that no two of the agent's samples repeat.
"""

import sys
import threading
import time

import torchtop

seconds = float(sys.argv[1])


churn = "--churn" in sys.argv


def work() -> None:
    end = time.time() + seconds
    held = b""
    step = 0
    while time.time() < end:
        time.sleep(0.01)
        if churn:
            step += 1
            held = b"\x01" * ((step % 37 + 1) << 18)  # 256 KiB to 9.5 MiB
        torchtop.step()
    del held


if "--thread" in sys.argv:
    threading.Thread(target=work, name="trainer").start()
    print(f"MAIN_RETURNED {time.time()}", flush=True)
else:
    work()
