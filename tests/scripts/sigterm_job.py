"""A job with a SIGTERM handler of its own: it says so and exits 3 (torchtop must not change
that). ``sigterm_job.py SECONDS``."""

import signal
import sys
import time


def graceful(signum: int, frame: object) -> None:
    print("GRACEFUL", flush=True)
    sys.exit(3)


signal.signal(signal.SIGTERM, graceful)
print("READY", flush=True)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    time.sleep(0.01)
