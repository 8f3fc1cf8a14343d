"""DataLoader workers: data wait, start-up, pinned batches, copy-on-write.

A training step can only start when its batch is ready. With ``num_workers=0`` the DataLoader
reads and decodes every sample in the training process itself, between steps, so the model
waits for the data and the data waits for the model. With ``num_workers=N`` that work moves to
N worker processes that prepare the next batches while the current step runs.

This demo uses a dataset whose ``__getitem__`` takes a few milliseconds per sample (a sleep
standing in for reading and decoding an image) and a small classifier, and measures, for each
way of loading:

- throughput: samples per second over a whole epoch, start-up included;
- the data wait: the time the training loop spends blocked in ``next()`` as a share of each
  step, measured by the loop itself, after the first batch;
- the first-batch latency: from ``iter(loader)`` to the first batch, which with workers
  includes starting them. ``persistent_workers=True`` keeps them between epochs, so only the
  first epoch pays it.

On CUDA it also runs ``pin_memory=True``, which has the workers' batches copied into
page-locked memory so the copy to the GPU is faster and can be asynchronous.

Last, the same rows held two ways, read by two forked workers: as a list of Python dicts, whose
pages are copied into each worker as reading them writes their reference counts, so each
worker's private memory (USS) grows through the epoch; and as one NumPy array, whose pages stay
shared. The demo prints each worker's private memory at the start and end of an epoch, and the
viewer's loaders panel shows it live.

Run it with ``torchtop demo dataloader`` to watch the loader's wait time live, or
``--headless`` for the table only.
"""

from __future__ import annotations

import gc
import math
import multiprocessing
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from torchtop.demos import _harness as harness

BATCH_SIZE = 8
#: How long one sample takes to "read and decode".
DECODE_SECONDS = 0.003


class DecodingDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Small fake images that each take ``decode_seconds`` to produce.

    It lives at module level so worker processes can find it: with the ``spawn`` start method
    (the default on macOS and Windows) each worker imports this module and unpickles the
    dataset; with ``fork`` (Linux) it inherits a copy.
    """

    def __init__(self, size: int, decode_seconds: float) -> None:
        self.size = size
        self.decode_seconds = decode_seconds

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Reading a file and decoding a JPEG, simulated: a sleep holds no CPU core, as disk
        # and network reads don't, so the workers' gain here does not depend on how many
        # cores are free. Real decoding burns CPU, and then workers help only as far as
        # there are idle cores for them.
        time.sleep(self.decode_seconds)
        generator = torch.Generator().manual_seed(index)
        image = torch.rand(3, 32, 32, generator=generator)
        image = (image - 0.5) / 0.25  # the usual normalization
        label = torch.tensor(index % 10)
        return image, label


class Classifier:
    """A small MLP and its optimizer: a step takes about as long as a few samples to load."""

    def __init__(self, device: torch.device) -> None:
        torch.manual_seed(0)
        self.device = device
        self.model = nn.Sequential(
            nn.Flatten(), nn.Linear(3 * 32 * 32, 1024), nn.ReLU(), nn.Linear(1024, 10)
        ).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def step(self, images: torch.Tensor, labels: torch.Tensor, non_blocking: bool) -> None:
        # non_blocking only helps from pinned memory; from pageable memory it is ignored.
        images = images.to(self.device, non_blocking=non_blocking)
        labels = labels.to(self.device, non_blocking=non_blocking)
        loss = nn.functional.cross_entropy(self.model(images), labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        if self.device.type == "cuda":
            # Wait for the GPU, so a step's time here is the GPU's time too (otherwise the CPU
            # races ahead and the wait shows up later, wherever it next syncs).
            torch.cuda.synchronize(self.device)


@dataclass(frozen=True)
class EpochStats:
    """One epoch, timed by the training loop itself."""

    seconds: float
    samples: int
    #: From ``iter(loader)`` to the first batch (with workers: starting them, if needed).
    first_batch: float
    #: Time blocked in ``next()`` over all steps after the first.
    waiting: float
    #: Whole steps (``next()`` plus training) after the first, and how many there were.
    stepping: float
    steps_after_first: int
    #: The last ``next()``, which raises StopIteration (without persistent workers it also
    #: shuts them down and waits for them to exit).
    ending: float

    @property
    def wait_fraction(self) -> float:
        return self.waiting / self.stepping if self.stepping > 0 else 0.0

    @property
    def step_seconds(self) -> float:
        """The average step after the first, waiting included."""
        return self.stepping / max(1, self.steps_after_first)


def run_epoch(
    loader: DataLoader[tuple[torch.Tensor, torch.Tensor]], model: Classifier
) -> EpochStats:
    """One pass over the loader, timing each ``next()`` and each step."""
    start = time.perf_counter()
    batches = iter(loader)  # with workers, this starts them (unless they persist)
    first_batch = waiting = stepping = ending = 0.0
    samples = 0
    while True:
        before_next = time.perf_counter()
        try:
            images, labels = next(batches)
        except StopIteration:  # without persistent workers, this also shuts them down
            ending = time.perf_counter() - before_next
            break
        got_batch = time.perf_counter()
        model.step(images, labels, non_blocking=loader.pin_memory)
        done = time.perf_counter()
        if samples == 0:
            first_batch = got_batch - start
        else:
            waiting += got_batch - before_next
            stepping += done - before_next
        samples += len(labels)
    seconds = time.perf_counter() - start
    steps_after_first = max(0, len(loader) - 1)
    return EpochStats(seconds, samples, first_batch, waiting, stepping, steps_after_first, ending)


def show_the_balance(
    options: harness.DemoOptions, dataset: DecodingDataset, model: Classifier
) -> None:
    """How long a batch takes to load, and a step to train: how many workers keep up."""
    harness.section(
        f"the data and the step: batches of {BATCH_SIZE}, "
        f"{harness.format_seconds(DECODE_SECONDS)} to decode each sample"
    )
    loader = DataLoader(dataset, batch_size=BATCH_SIZE)
    batches = iter(loader)
    start = time.perf_counter()
    images, labels = next(batches)
    load = time.perf_counter() - start
    model.step(images, labels, non_blocking=False)  # warm-up
    steps = []
    for _ in range(5):
        start = time.perf_counter()
        model.step(images, labels, non_blocking=False)
        steps.append(time.perf_counter() - start)
    step = statistics.median(steps)
    print(
        f"loading a batch in this process: {harness.format_seconds(load)}; "
        f"a training step on {options.device.type}: {harness.format_seconds(step)}"
    )
    # Each worker delivers a batch every `load` seconds; the loop consumes one every `step`.
    print(
        f"one worker delivers a batch every {harness.format_seconds(load)}, so keeping up "
        f"with the step takes about {math.ceil(load / step)} workers "
        f"({harness.format_seconds(load)} / {harness.format_seconds(step)}, rounded up); "
        "the demo compares 0 and 2"
    )


def measure_loading(
    name: str,
    options: harness.DemoOptions,
    model: Classifier,
    loader: DataLoader[tuple[torch.Tensor, torch.Tensor]],
    repeat: int,
    description: str,
) -> tuple[harness.PhaseResult, EpochStats]:
    """Train one epoch per call, as a measured phase; returns the result and the first epoch.

    :func:`harness.measure` runs the epoch once to warm up, ``repeat`` times (or more) for
    time, and once more for memory (and under the agent once in a profiler window); the
    columns come from the timed epochs.
    """
    epochs: list[tuple[str | None, EpochStats]] = []
    result = harness.measure(
        name,
        lambda: epochs.append((harness.current_pass(), run_epoch(loader, model))),
        device=options.device,
        repeat=repeat,
        description=description,
    )
    timed = [epoch for kind, epoch in epochs if kind == "timed"]
    samples_per_second = statistics.median(e.samples / e.seconds for e in timed)
    wait = statistics.median(e.wait_fraction for e in timed)
    first_batch = statistics.median(e.first_batch for e in timed)
    ending = statistics.median(e.ending for e in timed)
    step = statistics.median(e.step_seconds for e in timed)
    result = replace(
        result,
        extra={
            "samples/s": round(samples_per_second),
            "wait %": round(100 * wait, 1),
            "1st batch": harness.format_seconds(first_batch),
        },
    )
    print(
        f"{name}: {samples_per_second:.0f} samples/s; steps of {harness.format_seconds(step)}, "
        f"{100 * wait:.0f}% of it waiting for data; first batch after "
        f"{harness.format_seconds(first_batch)}, epoch end (StopIteration) after "
        f"{harness.format_seconds(ending)}"
    )
    return result, epochs[0][1]


def compare_workers(
    options: harness.DemoOptions, dataset: DecodingDataset, model: Classifier
) -> list[harness.PhaseResult]:
    """0 workers, 2 workers, 2 persistent workers (and 2 with pinned memory on CUDA)."""
    repeat = 2 if options.quick else 5
    ways = "four" if options.cuda else "three"
    harness.section(f"one epoch of {len(dataset)} samples, loaded {ways} ways")
    results = []

    # Every DataLoader uses the platform's default start method (multiprocessing_context=None).
    no_workers = DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True)
    result, _ = measure_loading(
        "0 workers",
        options,
        model,
        no_workers,
        repeat,
        "With num_workers=0 the training loop decodes every batch itself, so the model "
        "waits while data loads and loading waits while the model steps. The step time is "
        "load plus compute.",
    )
    results.append(result)
    harness.pause(options)

    # New worker processes each epoch: started by iter(), shut down when the epoch ends.
    two_workers = DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True, num_workers=2)
    result, _ = measure_loading(
        "2 workers",
        options,
        model,
        two_workers,
        repeat,
        "Two worker processes decode batches in parallel and prefetch them, so loading "
        "overlaps with the step. The workers start at iter() each epoch, which delays the "
        "first batch.",
    )
    results.append(result)
    harness.pause(options)

    # The same two processes for every epoch: only the first epoch starts them.
    persistent = DataLoader(
        dataset, batch_size=BATCH_SIZE, shuffle=True, num_workers=2, persistent_workers=True
    )
    result, first_epoch = measure_loading(
        "2, persistent",
        options,
        model,
        persistent,
        repeat,
        "persistent_workers=True keeps the same two processes for every epoch: only the "
        "first epoch pays for starting them (importing, forking, copying the dataset), so "
        "later epochs get their first batch at once.",
    )
    print(
        f"  (its first epoch waited {harness.format_seconds(first_epoch.first_batch)} for its "
        f"first batch, starting the workers; later epochs {result.extra['1st batch']})"
    )
    results.append(result)
    # Persistent workers live as long as the DataLoader: dropping it shuts them down.
    del persistent
    harness.pause(options)

    harness.section("pin_memory=True")
    if options.cuda:
        pinned = DataLoader(
            dataset, batch_size=BATCH_SIZE, shuffle=True, num_workers=2, pin_memory=True
        )
        result, _ = measure_loading(
            "2, pin_memory",
            options,
            model,
            pinned,
            repeat,
            "pin_memory=True copies each batch into page-locked memory in a background "
            "thread, so the copy to the GPU is faster and, with non_blocking=True, overlaps "
            "with compute.",
        )
        results.append(result)
        harness.pause(options)
    else:
        print(
            "skipped on CPU: pin_memory=True copies each batch into page-locked memory so the "
            "copy to a GPU is faster and can overlap with compute. With no GPU there is no "
            "such copy (DataLoader only warns and ignores it)."
        )
    return results


#: Rows of the copy-on-write phases read per item, and the rows in all (quick, full).
ROWS_PER_BLOCK = 1000
COW_BLOCKS = (100, 400)


class Rows(Dataset[torch.Tensor]):
    """Rows read a block at a time, held as a list of Python dicts or as one NumPy array.

    Forked workers inherit the rows without a copy. Reading a dict (or a float in it) writes
    its reference count, and the page it lives on is copied into the worker: with every page
    of the list read, each worker ends up with its own copy. An array's rows are read from its
    one buffer, which no reference count touches: its pages stay shared.
    """

    def __init__(self, rows: Any) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows) // ROWS_PER_BLOCK

    def __getitem__(self, index: int) -> torch.Tensor:
        block = self.rows[index * ROWS_PER_BLOCK : (index + 1) * ROWS_PER_BLOCK]
        if isinstance(block, list):
            return torch.tensor([(r["x"], float(r["y"]), len(r["name"])) for r in block])
        return torch.from_numpy(block.copy())


def make_rows(n: int, as_array: bool) -> Any:
    """``n`` rows: ``{"x", "y", "name"}`` dicts, or the same numbers as an ``(n, 3)`` array."""
    if as_array:
        import numpy as np

        index = np.arange(n, dtype=np.float64)
        return np.stack([index, index % 7, np.full(n, 7.0)], axis=1)
    return [{"x": float(i), "y": i % 7, "name": f"row {i:03d}"} for i in range(n)]


def private_per_worker(iterator: Any) -> int | None:
    """The mean private memory (USS, ``/proc/PID/smaps_rollup``) of an iterator's workers
    now; ``None`` where it cannot be read (not Linux)."""
    from torchtop.streams.worker_memory import read_workers

    pids = [p.pid for p in getattr(iterator, "_workers", ()) if p.pid is not None]
    memory = read_workers(pids)
    if not memory.workers:
        return None
    return memory.uss // len(memory.workers)


def cow_epoch(loader: DataLoader[torch.Tensor], readings: list[tuple[int, int]]) -> float:
    """One pass over ``loader``, with the workers' private memory after the first batch and
    after the last (before the epoch's end shuts them down) appended to ``readings``."""
    batches = iter(loader)
    total = 0.0
    first: int | None = None
    last: int | None = None
    with torch.no_grad():  # reading the data, not training on it
        for i, block in enumerate(batches):
            total += float(block[:, 0].sum())
            if i == 0:
                first = private_per_worker(batches)
            if i == len(loader) - 1:
                last = private_per_worker(batches)
    if first is not None and last is not None:
        readings.append((first, last))
    return total


def compare_copy_on_write(options: harness.DemoOptions) -> list[harness.PhaseResult]:
    """The same rows as Python dicts and as a NumPy array, read by two forked workers: the
    workers' private memory at the start and end of each epoch."""
    if "fork" not in multiprocessing.get_all_start_methods():
        print("skipped: this platform cannot fork workers (copy-on-write needs fork)")
        return []
    rows = COW_BLOCKS[0 if options.quick else 1] * ROWS_PER_BLOCK
    harness.section(f"copy-on-write: {rows:,} rows, two forked workers")
    results = []
    for name, as_array, description in (
        (
            "dicts, forked",
            False,
            "The rows are a list of Python dicts. Forked workers share the parent's pages until "
            "Python writes a reference count: every row read copies its page into the worker, "
            "so each worker's private memory grows to a copy of the data.",
        ),
        (
            "array, forked",
            True,
            "The same rows as one NumPy array: a read copies numbers out of its buffer and "
            "writes no reference count on it, so its pages stay shared and the workers' private "
            "memory stays flat.",
        ),
    ):
        dataset = Rows(make_rows(rows, as_array))
        loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="fork")
        readings: list[tuple[int, int]] = []
        result = harness.measure(
            name,
            lambda loader=loader, readings=readings: cow_epoch(loader, readings),
            device="cpu",
            repeat=2 if options.quick else 3,
            description=description,
        )
        if readings:
            first = statistics.median(r[0] for r in readings)
            last = statistics.median(r[1] for r in readings)
            extra = {
                "private/worker": harness.Bytes(int(last)),
                "at start": harness.Bytes(int(first)),
            }
            print(
                f"{name}: each worker's private memory (USS) went from "
                f"{harness.format_bytes(int(first))} after its first block to "
                f"{harness.format_bytes(int(last))} after its last"
            )
        else:
            extra = {"private/worker": "n/a"}
            print(f"{name}: the workers' private memory cannot be read here (no /proc)")
        results.append(replace(result, extra=extra))
        del dataset, loader
        gc.collect()
        harness.pause(options)
    return results


def check_no_workers_left(timeout: float = 10.0) -> None:
    """Wait for the workers of every DataLoader that is gone to exit, and count those left.

    A DataLoader shuts its workers down when its iterator is freed, which can be a moment
    after the last name for it goes: when a reference cycle holds it until the garbage
    collector runs, or another thread (a monitoring one, say) briefly holds it.
    """
    gc.collect()
    deadline = time.monotonic() + timeout
    # active_children() also reaps the processes that have exited.
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    print(f"worker processes left running: {len(multiprocessing.active_children())}")


def conclusion(results: list[harness.PhaseResult]) -> str:
    no_workers, two, persistent = results[:3]
    wait_before, wait_after = no_workers.extra["wait %"], two.extra["wait %"]
    verb = "cut" if wait_after < wait_before else "raised"
    text = (
        f"2 workers {verb} the data wait from {wait_before:.0f}% to {wait_after:.0f}% of each "
        f"step and {harness.speed_clause(two, no_workers, '0 workers')} "
        f"({no_workers.extra['samples/s']} to {two.extra['samples/s']} samples/s); "
        f"persistent workers brought each later epoch's first batch from "
        f"{two.extra['1st batch']} to {persistent.extra['1st batch']}"
    )
    pinned = next((r for r in results if r.name == "2, pin_memory"), None)
    if pinned is not None:
        text += (
            f"; pin_memory gave {pinned.extra['samples/s']} samples/s against "
            f"{two.extra['samples/s']}"
        )
    return text + "."


def cow_conclusion(results: list[harness.PhaseResult]) -> str:
    cow = {r.name: r.extra.get("private/worker") for r in results}
    dicts, array = cow.get("dicts, forked"), cow.get("array, forked")
    if not isinstance(dicts, harness.Bytes) or not isinstance(array, harness.Bytes):
        return "Forked workers' private memory could not be read here (it needs Linux's /proc)."
    return (
        f"Forked workers reading Python dicts ended with {harness.format_bytes(dicts)} private "
        f"each, against {harness.format_bytes(array)} reading the same rows from a NumPy array: "
        "the dicts' pages were copied into each worker as their reference counts were written."
    )


def main() -> None:
    options = harness.begin(__doc__, "dataloader")
    batches = 12 if options.quick else 40
    dataset = DecodingDataset(batches * BATCH_SIZE, DECODE_SECONDS)
    model = Classifier(options.device)
    show_the_balance(options, dataset, model)
    results = compare_workers(options, dataset, model)
    cow = compare_copy_on_write(options)
    check_no_workers_left()
    harness.print_results(
        f"DataLoader on {options.device}: time per epoch of {len(dataset)} samples",
        results,
        conclusion(results),
    )
    if cow:
        harness.print_results(
            "Forked workers' private memory (USS) at the end of an epoch", cow, cow_conclusion(cow)
        )
    harness.emit_json_results([*results, *cow])


if __name__ == "__main__":
    main()
