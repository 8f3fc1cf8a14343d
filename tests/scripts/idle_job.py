"""A job that does no training and never imports torch: it sleeps until its time is up.

``idle_job.py SECONDS [--thread]``: with ``--thread`` the main script returns at once and a
non-daemon thread counts steps (``torchtop.step()``) for SECONDS, printing when main returned.
"""

import sys
import threading
import time

import torchtop

seconds = float(sys.argv[1])


def work() -> None:
    end = time.time() + seconds
    while time.time() < end:
        time.sleep(0.01)
        torchtop.step()


if "--thread" in sys.argv:
    threading.Thread(target=work, name="trainer").start()
    print(f"MAIN_RETURNED {time.time()}", flush=True)
else:
    work()
