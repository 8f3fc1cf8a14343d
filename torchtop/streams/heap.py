"""The garbage collector of a process that follows jobs for hours: the viewer, the exporter.

Each frame makes thousands of short-lived objects (Rich and Textual segments, strips, texts).
CPython collects its youngest generation every 700 allocations and, every so often, walks every
object the process holds: Textual, Rich, the modules and the app's own widgets, ~60 thousand
that live as long as the app. A chatty job's viewer spent ~4 ms a second collecting (a full
walk took ~50 ms). While an app runs, :class:`SettledHeap` leaves the objects that exist once
it is mounted out of every collection and collects the youngest generation less often (the
same work in total for it, far less for the older ones): ~0.6 ms a second.

An exporter of many ranks holds their models: 1,024 ranks are ~600 thousand objects (their
recent step points), renewed as the steps come. CPython walked them all every few seconds (the
oldest generation is collected once a quarter of it is new), each walk up to a second during
which no scrape is answered. The exporter collects its oldest generation at most once every
:data:`EXPORTER_OLD_THRESHOLD` collections of the middle one: cycles among young objects are
collected as before; a cycle that reached the oldest generation waits longer.
"""

from __future__ import annotations

import gc

#: Allocations (less deallocations) between two collections of the youngest generation.
YOUNG_THRESHOLD = 10_000
#: Collections of the middle generation between two of the oldest, in an exporter (CPython's
#: default is 10, and the quarter rule above).
EXPORTER_OLD_THRESHOLD = 100
#: The heap settled now, if any: a screen opened over another (a rank's over its run's) finds
#: the heap settled already, and leaves it to the screen that settled it.
_settled: SettledHeap | None = None


class SettledHeap:
    """From a screen's mount (:meth:`settle`) to its end (:meth:`release`); one at a time.
    ``old``: the oldest generation's threshold while settled (the process's own if ``None``)."""

    def __init__(self, old: int | None = None) -> None:
        self._threshold: tuple[int, int, int] | None = None
        self._old = old

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
        gc.set_threshold(
            max(YOUNG_THRESHOLD, young), middle, old if self._old is None else max(old, self._old)
        )

    def release(self) -> None:
        """The app (or exporter) has ended: its objects (and start-up's) are collected as
        usual again, so a process that runs another app after it (the run view, then a rank's
        screens; a test suite) keeps none of them."""
        global _settled
        if self._threshold is None:
            return
        gc.unfreeze()
        gc.set_threshold(*self._threshold)
        self._threshold = None
        _settled = None
