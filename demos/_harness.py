"""What every demo shares: its options, measuring a phase, and printing what was measured.

Not a demo itself (the leading underscore keeps it out of ``torchtop demo --list``). A demo
runs each variant of its topic through :func:`measure`, which marks it as a phase on the
torchtop timeline and measures its time and its peak memory, then hands the results to
:func:`print_results` with a conclusion built from the numbers by :func:`ratio_sentence`, and
ends with :func:`emit_json_results` so tests can check the measured values.

Demos run the same with or without the torchtop agent: ``torchtop.phase`` costs next to
nothing when no agent listens.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import torchtop
from torchtop.agent.ops import paused as op_windows_paused
from torchtop.agent.ops import window as op_window
from torchtop.agent.tensor_tracker import TensorTracker

#: The prefix of the machine-readable result line (see :func:`emit_json_results`).
RESULT_PREFIX = "TORCHTOP_DEMO_RESULT"
#: Table width when the output is not a terminal: under the torchtop viewer each output line
#: becomes a log line, and a wide table would wrap into noise there.
PLAIN_WIDTH = 78


@dataclass(frozen=True)
class DemoOptions:
    """The options every demo takes."""

    #: Small sizes and few repeats: the whole demo in at most 20 s on 2 CPU cores (for CI).
    quick: bool
    device: torch.device

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass(frozen=True)
class PhaseResult:
    """One measured phase of a demo."""

    name: str
    #: Median wall time of one call of the phase's function.
    seconds: float
    #: Peak bytes of tensor memory the function allocated above what was live before it.
    peak_bytes: int
    #: Anything else the demo wants in the table and the result line (shapes, counts...).
    extra: dict[str, Any] = field(default_factory=dict)


class Bytes(int):
    """A byte count in a phase's ``extra``: an ``int`` in the result line, ``"4.00 MiB"`` in
    the table."""


# -- options -------------------------------------------------------------------------------


def parse_args(description: str, argv: Sequence[str] | None = None) -> DemoOptions:
    """Parse ``--quick`` and ``--device``; the default device is CUDA when there is one.

    Also makes stdout line-buffered: under torchtop, stdout is a pipe, and each line should
    reach the viewer's log when it is printed, not when a buffer fills.
    """
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small sizes and few repeats: a few seconds on a laptop CPU (used by CI)",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the tensors live (default: cuda when available, else cpu)",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        from torchtop.cli import NO_CUDA

        parser.exit(2, f"torchtop: {NO_CUDA}\n")
    return DemoOptions(quick=args.quick, device=torch.device(args.device))


def begin(doc: str | None, name: str, argv: Sequence[str] | None = None) -> DemoOptions:
    """A demo's start: its options (:func:`parse_args`, described by the first line of its
    docstring ``doc``, else ``name``) and the line that says where it runs."""
    options = parse_args(doc.splitlines()[0] if doc else name, argv)
    print(f"device: {options.device}{' (quick)' if options.quick else ''}")
    return options


def section(title: str) -> None:
    """A heading between the parts of a demo's output."""
    print(f"\n== {title} ==")


def pause(options: DemoOptions, seconds: float = 1.0) -> None:
    """A gap between phases, so each shows as its own rise and fall on the live memory chart."""
    time.sleep(seconds / 4 if options.quick else seconds)


# -- measuring -----------------------------------------------------------------------------


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    name: str,
    fn: Callable[[], Any],
    *,
    device: torch.device | str,
    repeat: int,
    min_seconds: float = 0.0,
    extra: dict[str, Any] | None = None,
    description: str | None = None,
) -> PhaseResult:
    """Run ``fn`` as the phase ``name`` and measure its time and peak memory.

    ``description``, two or three sentences on what the phase does and why it is fast or slow,
    heavy or light, is shown beside the memory chart while the phase runs in the viewer.

    Time and memory come from separate passes so that the memory tracker's per-op cost never
    shows in the time: one warm-up call, then a timing pass (the median of ``repeat`` calls,
    more if needed to keep the phase running for ``min_seconds`` so a viewer can watch it),
    then one memory pass. The torchtop agent's sampled profiler windows stay out of all of
    them; under the agent, one more call (when a call takes under a second) runs in a
    profiler window of its own, for the viewer's ops panel. On CPU the memory pass counts
    tensor storages with
    :class:`TensorTracker`; on CUDA it reads the caching allocator's peak. Either way the
    figure is the peak above what was allocated before the call, so inputs made beforehand
    do not count, and what ``fn`` returns does.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with torchtop.phase(name, description), untimed_by_profiler():
        _pass[0] = "warm-up"
        result = fn()  # first-call costs (allocator growth, kernel selection)
        _synchronize(device)
        del result

        _pass[0] = "timed"
        times: list[float] = []
        phase_start = time.perf_counter()
        while len(times) < max(1, repeat) or time.perf_counter() - phase_start < min_seconds:
            start = time.perf_counter()
            result = fn()
            _synchronize(device)
            times.append(time.perf_counter() - start)
            del result

        # Under the torchtop agent, one more call in a profiler window of its own: the
        # viewer's ops panel (key t) shows this phase's ops, sync points and copies.
        _pass[0] = "profiled"
        if statistics.median(times) < PROFILED_CALL_MAX_S:
            with op_window() as opened:
                if opened:
                    result = fn()
                    _synchronize(device)
                    del result

        _pass[0] = "memory"
        gc.collect()
        peak = _peak_bytes(fn, device)
    _pass[0] = None
    return PhaseResult(name, statistics.median(times), peak, dict(extra or {}))


def current_pass() -> str | None:
    """Which of :func:`measure`'s calls is running: ``"warm-up"``, ``"timed"``,
    ``"profiled"``, ``"memory"``; ``None`` outside it. For a demo that records something per
    call and must keep only the timed calls' records."""
    return _pass[0]


#: The pass of :func:`measure` that is running (see :func:`current_pass`).
_pass: list[str | None] = [None]
#: Phases whose call takes longer than this get no profiled call of their own.
PROFILED_CALL_MAX_S = 1.0


def untimed_by_profiler() -> AbstractContextManager[None]:
    """A section the torchtop agent's sampled profiler windows stay out of (none without an
    agent): a window would slow the ops it records several times and skew the timing."""
    return op_windows_paused()


def _peak_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    if device.type == "cuda":
        _synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        _synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        del result
        return max(0, peak)
    # A fresh tracker counts only what is allocated inside it: "above what was live before".
    with TensorTracker() as tracker:
        result = fn()
        del result
    return tracker.peak_bytes


class MemoryMeter:
    """Live and peak bytes of tensor memory allocated since the meter began, on CPU or CUDA.

    For what a demo wants to watch while it runs (what a graph still holds after the forward,
    live bytes step after step), where :func:`measure`'s single peak is not enough. On CPU it
    counts tensor storages with :class:`TensorTracker`; on CUDA it reads the caching
    allocator, so there it sees everything allocated on the device, by any code.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._tracker: TensorTracker | None = None
        self._baseline = 0

    @property
    def live_bytes(self) -> int:
        if self._tracker is not None:
            return self._tracker.live_bytes
        _synchronize(self.device)
        return max(0, torch.cuda.memory_allocated(self.device) - self._baseline)

    @property
    def peak_bytes(self) -> int:
        if self._tracker is not None:
            return self._tracker.peak_bytes
        _synchronize(self.device)
        return max(0, torch.cuda.max_memory_allocated(self.device) - self._baseline)


@contextmanager
def track_memory(device: torch.device | str) -> Iterator[MemoryMeter]:
    """``with track_memory(device) as meter: ...; meter.live_bytes`` (see :class:`MemoryMeter`).

    On CPU every op inside the block goes through the tracker (tens of microseconds an op):
    measure time outside it.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    meter = MemoryMeter(device)
    gc.collect()
    if device.type == "cuda":
        _synchronize(device)
        meter._baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield meter
        return
    with TensorTracker() as tracker:
        meter._tracker = tracker
        yield meter


def emulated_device() -> Any | None:
    """The ``--memory-limit`` emulation when this job runs under it (``torchtop run`` or
    ``torchtop demo`` with ``--memory-limit SIZE`` on the CPU), else ``None``.

    Its ``limit_bytes`` is the emulated device's size and ``live_bytes`` the tensor bytes
    counted against it: every storage the job's thread has allocated and still holds.
    """
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from torchtop.agent.memory_limit import MemoryLimitTracker

    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, MemoryLimitTracker) and mode.limit_bytes is not None:
            return mode
    return None


# -- reporting -----------------------------------------------------------------------------


def format_bytes(n: int) -> str:
    """Bytes in binary units with three significant digits: ``"32.0 MiB"``."""
    value = float(n)
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    unit = 0
    while abs(value) >= 1024 and unit < len(units) - 1:
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{int(value)} B"
    digits = 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2
    return f"{value:.{digits}f} {units[unit]}"


def format_seconds(seconds: float) -> str:
    """A duration in the unit that keeps three significant digits: ``"12.3 ms"``."""
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if seconds >= scale or unit == "us":
            value = seconds / scale
            digits = 0 if value >= 100 else 1 if value >= 10 else 2
            return f"{value:.{digits}f} {unit}"
    raise AssertionError("unreachable")


def _times_sign() -> str:
    """:data:`TIMES` where stdout can write it, else ``x`` (a pipe with an ASCII locale)."""
    encoding = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        TIMES.encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return "x"
    return TIMES


def _ratio(bigger: float, smaller: float) -> str:
    ratio = bigger / smaller
    return f"{ratio:.0f}{_times_sign()}" if ratio >= 100 else f"{ratio:.1f}{_times_sign()}"


#: The multiplication sign, where the output can carry it.
TIMES = "\u00d7"

#: Two figures within this factor of each other are reported as "about the same".
SAME_WITHIN = 1.05


def _compare(good: float, bad: float) -> int:
    """-1 when ``good`` is clearly smaller than ``bad``, 1 when clearly larger, else 0."""
    if good * SAME_WITHIN < bad:
        return -1
    if bad * SAME_WITHIN < good:
        return 1
    return 0


def memory_phrase(good: PhaseResult, bad: PhaseResult) -> str:
    """``"4.0x less peak memory"``, ``"1.2x more peak memory"`` or ``"about the same ..."``."""
    direction = _compare(good.peak_bytes, bad.peak_bytes)
    if direction == 0:
        return "about the same peak memory"
    if direction < 0:
        if good.peak_bytes == 0:
            return f"no tensor memory against {format_bytes(bad.peak_bytes)}"
        return f"{_ratio(bad.peak_bytes, good.peak_bytes)} less peak memory"
    if bad.peak_bytes == 0:
        return f"{format_bytes(good.peak_bytes)} of tensor memory against none"
    return f"{_ratio(good.peak_bytes, bad.peak_bytes)} more peak memory"


def speed_phrase(good: PhaseResult, bad: PhaseResult) -> str:
    """``"2.7x faster"``, ``"1.3x slower"`` or ``"about as fast"``."""
    direction = _compare(good.seconds, bad.seconds)
    if direction == 0 or min(good.seconds, bad.seconds) <= 0:
        return "about as fast"
    if direction < 0:
        return f"{_ratio(bad.seconds, good.seconds)} faster"
    return f"{_ratio(good.seconds, bad.seconds)} slower"


def ratio_sentence(good: PhaseResult, *others: PhaseResult) -> str:
    """How ``good`` compared with each of ``others``, in words, from the measured numbers.

    ``"broadcasting used 4.0x less peak memory and ran 2.7x faster than repeat"``; with
    several others, one clause each, joined.
    """
    if not others:
        raise ValueError("ratio_sentence needs at least one phase to compare with")
    clauses = []
    for bad in others:
        memory = memory_phrase(good, bad)
        speed = speed_phrase(good, bad)
        if memory.startswith("about the same"):
            clause = f"used about the same peak memory as {bad.name} and ran {speed}"
            if speed == "about as fast":
                clause = f"used about the same peak memory and time as {bad.name}"
        elif speed == "about as fast":
            clause = f"used {memory} than {bad.name} and ran about as fast"
        else:
            clause = f"used {memory} and ran {speed} than {bad.name}"
        clauses.append(clause)
    return f"{good.name} " + ", and ".join(clauses)


def speed_clause(good: PhaseResult, bad: PhaseResult, than: str | None = None) -> str:
    """``"ran 2.7x faster than repeat"``, ``"ran 1.3x slower than ..."`` or ``"ran about as
    fast as ..."``; ``than`` names ``bad`` in the sentence (default: its phase name)."""
    name = bad.name if than is None else than
    speed = speed_phrase(good, bad)
    if speed == "about as fast":
        return f"ran about as fast as {name}"
    return f"ran {speed} than {name}"


def comparison_clause(good: PhaseResult, bad: PhaseResult, than: str | None = None) -> str:
    """``"used 4.0x less peak memory than repeat and ran 2.7x faster"``, worded for every
    outcome (the same, none at all); ``than`` names ``bad`` (default: its phase name)."""
    name = bad.name if than is None else than
    direction = _compare(good.peak_bytes, bad.peak_bytes)
    speed = speed_phrase(good, bad)
    if direction == 0:
        if speed == "about as fast":
            return f"used about the same peak memory and time as {name}"
        memory = f"used about the same peak memory as {name}"
    elif direction < 0 and good.peak_bytes == 0:
        memory = f"used no tensor memory where {name} used {format_bytes(bad.peak_bytes)}"
    elif direction > 0 and bad.peak_bytes == 0:
        memory = f"used {format_bytes(good.peak_bytes)} of tensor memory where {name} used none"
    else:
        memory = f"used {memory_phrase(good, bad)} than {name}"
    return f"{memory} and ran {speed}"


def _format_extra(value: Any) -> str:
    if isinstance(value, Bytes):
        return format_bytes(value)
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, (tuple, list, torch.Size)):
        return _times_sign().join(str(v) for v in value)
    return str(value)


def print_results(title: str, results: Sequence[PhaseResult], conclusion: str) -> None:
    """The measured table (phase, time, peak memory, extra columns) and the conclusion line.

    On a terminal it is a normal rich table. Elsewhere (a pipe, a file, the torchtop viewer's
    log) it is plain ASCII, no colour, at most 78 columns wide.
    """
    from rich import box
    from rich.console import Console
    from rich.table import Table

    terminal = sys.stdout.isatty()
    console = (
        Console(highlight=False)
        if terminal
        else Console(
            width=PLAIN_WIDTH,
            color_system=None,
            force_terminal=False,
            highlight=False,
            emoji=False,
        )
    )
    table = Table(box=box.ROUNDED if terminal else box.ASCII, expand=False)
    table.add_column("phase", overflow="fold")
    table.add_column("time", justify="right", no_wrap=True)
    table.add_column("peak memory", justify="right", no_wrap=True)
    extra_keys: list[str] = []
    for result in results:
        extra_keys += [key for key in result.extra if key not in extra_keys]
    for key in extra_keys:
        table.add_column(key, justify="right", overflow="fold")
    for result in results:
        table.add_row(
            result.name,
            format_seconds(result.seconds),
            format_bytes(result.peak_bytes),
            *(
                _format_extra(result.extra[key]) if key in result.extra else ""
                for key in extra_keys
            ),
        )
    console.print()
    console.print(title, markup=False)
    console.print(table)
    # One line even when longer than the table: a log line, or a terminal's own wrapping.
    console.print(conclusion, soft_wrap=True, markup=False)
    sys.stdout.flush()


def emit_json_results(results: Sequence[PhaseResult]) -> None:
    """One line, ``TORCHTOP_DEMO_RESULT {json}``, with every measured value, for tests.

    Printed only when the environment variable of the same name is ``1``, so that people
    watching a demo see the table, not machine-readable output.
    """
    if os.environ.get(RESULT_PREFIX) != "1":
        return
    payload = {"results": [asdict(result) for result in results]}
    print(f"{RESULT_PREFIX} {json.dumps(payload, default=str)}", flush=True)


def parse_result_line(output: str) -> list[PhaseResult]:
    """The results from a demo's output (its last ``TORCHTOP_DEMO_RESULT`` line)."""
    lines = [line for line in output.splitlines() if line.startswith(RESULT_PREFIX + " ")]
    if not lines:
        raise ValueError(f"no {RESULT_PREFIX} line in the output")
    payload = json.loads(lines[-1][len(RESULT_PREFIX) + 1 :])
    return [PhaseResult(**entry) for entry in payload["results"]]
