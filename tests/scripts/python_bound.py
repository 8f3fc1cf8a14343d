"""A job whose steps are pure Python (they hold the GIL throughout), for SECONDS seconds.

``python_bound.py SECONDS``: each step sums a range and calls ``torchtop.step()``.
"""

import sys
import time

import torchtop

end = time.time() + float(sys.argv[1])
while time.time() < end:
    sum(range(20_000))
    torchtop.step()
