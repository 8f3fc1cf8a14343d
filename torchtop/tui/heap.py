"""The viewer's garbage collector, set for a process that draws frames for hours.

Each frame makes thousands of short-lived objects (Rich and Textual segments, strips, texts).
CPython collects its youngest generation every 700 allocations and, every so often, walks every
object the process holds: Textual, Rich, the modules and the app's own widgets, ~60 thousand
that live as long as the app. A chatty job's viewer spent ~4 ms a second collecting (a full
walk took ~50 ms). While an app runs, :class:`SettledHeap` leaves the objects that exist once
it is mounted out of every collection and collects the youngest generation less often (the
same work in total for it, far less for the older ones): ~0.6 ms a second.
"""

from __future__ import annotations

import gc

#: Allocations (less deallocations) between two collections of the youngest generation.
YOUNG_THRESHOLD = 10_000
#: The heap settled now, if any: a screen opened over another (a rank's over its run's) finds
#: the heap settled already, and leaves it to the screen that settled it.
_settled: SettledHeap | None = None


class SettledHeap:
    """From a screen's mount (:meth:`settle`) to its end (:meth:`release`); one at a time."""

    def __init__(self) -> None:
        self._threshold: tuple[int, int, int] | None = None

    def settle(self) -> None:
        """Freeze what exists now (it lives as long as the app) and raise the youngest
        generation's threshold."""
        global _settled
        if self._threshold is not None or _settled is not None:
            return
        _settled = self
        self._threshold = gc.get_threshold()
        young, middle, old = self._threshold
        gc.freeze()
        gc.set_threshold(max(YOUNG_THRESHOLD, young), middle, old)

    def release(self) -> None:
        """The app has ended: its objects (and start-up's) are collected as usual again, so a
        process that runs another app after it (the run view, then a rank's screens; a test
        suite) keeps none of them."""
        global _settled
        if self._threshold is None:
            return
        gc.unfreeze()
        gc.set_threshold(*self._threshold)
        self._threshold = None
        _settled = None
