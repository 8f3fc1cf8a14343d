"""Copy-on-write, seen from outside: a forked child reading the parent's Python objects gains
private memory (USS) page by page; the same data as one NumPy array stays shared."""

from __future__ import annotations

import numpy as np

from tests.conftest import Forked
from torchtop.streams.worker_memory import read_worker

MB = 1 << 20


def _uss_growth_after_reading(data: object, read) -> int:  # type: ignore[no-untyped-def]
    """Fork, read ``data`` in the child, and return how much the child's USS grew (bytes)."""

    def child(parent: Forked) -> None:  # a DataLoader worker's life, in short
        parent.send(b"r")
        parent.receive()
        read(data)
        parent.send(b"d")
        parent.receive()

    with Forked(child) as worker:
        assert worker.receive() == b"r"
        before = read_worker(worker.pid)
        worker.send(b"g")
        assert worker.receive() == b"d", "the child failed to read the data"
        after = read_worker(worker.pid)
        worker.send(b"g")
        assert before is not None and after is not None
        return after.uss - before.uss


def _touch_dicts(rows: list[dict[str, object]]) -> None:
    for row in rows:  # reading a dict writes its reference count: its page is copied
        _ = row["label"]


def test_python_objects_are_copied_numpy_stays_shared() -> None:
    n = 200_000  # ~60 MB of small dicts
    rows = [{"label": i, "name": f"s{i}", "vec": [float(i)] * 4} for i in range(n)]
    array = np.arange(n * 8, dtype=np.float64)  # ~13 MB, one buffer
    grew_objects = _uss_growth_after_reading(rows, _touch_dicts)
    grew_array = _uss_growth_after_reading(array, lambda a: float(a.sum()))
    assert grew_objects > 20 * MB, grew_objects
    assert grew_array < 4 * MB, grew_array
