"""What a dataset keeps its data in, as the agent reads it once per DataLoader (its attributes'
types, a few items sampled): Python containers, which forked workers copy page by page, or
arrays, which stay shared. On real torch datasets and NumPy arrays."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset, TensorDataset

from torchtop.agent.loaders import LoaderTracker, dataset_storage


class Rows(Dataset):  # type: ignore[type-arg]
    def __init__(self, rows: Any) -> None:
        self.rows = rows
        self.name = "rows"

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Any:
        return self.rows[i]


def dicts(n: int) -> list[dict[str, Any]]:
    return [{"x": float(i), "y": i % 7, "name": f"row {i}"} for i in range(n)]


def test_python_containers_are_found_with_what_they_hold() -> None:
    assert dataset_storage(Rows(dicts(5000))) == ("python", "list of 5,000 dict in .rows")
    assert dataset_storage(dicts(2000)) == ("python", "list of 2,000 dict (the dataset itself)")
    by_id = Rows({i: f"text {i}" for i in range(3000)})
    assert dataset_storage(by_id) == ("python", "dict of 3,000 str in .rows")
    objects = Rows(np.array([{"x": i} for i in range(10)], dtype=object))
    kind, detail = dataset_storage(objects) or ("", "")
    assert kind == "python" and "dtype object" in detail
    # Through a wrapper: Subset keeps the dataset in .dataset.
    wrapped = dataset_storage(Subset(Rows(dicts(4000)), range(100)))
    assert wrapped == ("python", "list of 4,000 dict in .rows of .dataset")


def test_arrays_tensors_and_memory_maps_are_arrays(tmp_path: Path) -> None:
    assert dataset_storage(Rows(np.zeros((5000, 2)))) == ("arrays", "numpy.ndarray in .rows")
    tensors = dataset_storage(TensorDataset(torch.zeros(5000, 2), torch.zeros(5000)))
    # TensorDataset's tuple of two tensors is small: it is the tensors that hold the data.
    assert tensors is None or tensors[0] == "arrays"
    mapped = np.memmap(tmp_path / "rows.bin", dtype=np.float32, mode="w+", shape=(5000, 2))
    assert dataset_storage(Rows(mapped)) == ("arrays", "a memory-mapped array in .rows")
    many = [np.zeros(3) for _ in range(2000)]
    assert dataset_storage(Rows(many)) == ("arrays", "list of 2,000 arrays in .rows")
    # A Python container beside the arrays is what counts.
    mixed = Rows(np.zeros((10, 2)))
    mixed.labels = [f"label {i}" for i in range(5000)]  # type: ignore[attr-defined]
    assert dataset_storage(mixed) == ("python", "list of 5,000 str in .labels")


def test_small_or_unreadable_datasets_are_not_known() -> None:
    assert dataset_storage(Rows(dicts(10))) is None
    assert dataset_storage(ConcatDataset([Rows(dicts(10))])) is None
    assert dataset_storage(None) is None

    class Odd:
        @property
        def __dict__(self) -> Any:  # type: ignore[override]
            raise RuntimeError("changed under the read")

    assert dataset_storage(Odd()) is None


def test_the_loaders_frame_carries_it() -> None:
    loader = DataLoader(Rows(dicts(3000)), batch_size=100)
    iterator = iter(loader)
    tracker = LoaderTracker()
    import weakref

    from torchtop.agent.loaders import settings_of

    tracker.iterator_created(
        id(iterator), weakref.ref(iterator), id(loader), weakref.ref(loader),
        settings_of(loader), id(loader.dataset),
    )  # fmt: skip
    frame = tracker.frame(1.0)
    assert frame is not None
    (stats,) = frame.loaders
    assert (stats.dataset_storage, stats.dataset_detail) == (
        "python",
        "list of 3,000 dict in .rows",
    )


def test_a_containers_own_methods_are_never_run() -> None:
    class Lazy(list):  # type: ignore[type-arg]
        """A list whose items load on access: the job's code, not to be run by the agent."""

        calls = 0

        def __getitem__(self, i: Any) -> Any:
            Lazy.calls += 1
            return super().__getitem__(i)

        def __len__(self) -> int:
            Lazy.calls += 1
            return super().__len__()

    assert dataset_storage(Rows(Lazy(range(5000)))) is None
    assert Lazy.calls == 0
