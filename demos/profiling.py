"""Finding where time goes: torch.profiler, cProfile, and a shape error.

Guessing where a training step spends its time is usually wrong; a profiler tells you. This
demo trains a small model and looks at it three ways:

- ``torch.profiler.profile`` records every operator (and on CUDA every kernel): the table of
  the top ops by their own CPU time, and a Chrome trace of the same steps that you can open in
  https://ui.perfetto.dev or chrome://tracing to see them on a timeline. It measures what the
  profiler itself costs, since a profiled step is slower than a real one.
- ``torch.utils.bottleneck`` used to run a script under cProfile and the autograd profiler in
  one go. It is gone from recent PyTorch releases; its first half is plain ``python -m cProfile
  -s cumtime script.py``, which sees Python functions (your code, the optimizer, module calls)
  where torch.profiler sees operators.
- A shape mismatch, ``nn.Linear(128, 64)`` fed a ``[32, 100]`` batch: the error caught and
  traced to the line and the module it came from, and how to read the message.

Run it with ``torchtop demo profiling`` to watch each phase live, or ``--headless`` for the
table only.
"""

from __future__ import annotations

import cProfile
import dataclasses
import importlib.util
import io
import json
import os
import pstats
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from torchtop.demos import _harness as harness

#: Where the demo's own code lives, to tell its frames from torch's in a traceback.
THIS_FILE = Path(__file__).resolve()
#: The width the demo's own text keeps to (the viewer's log, a narrow terminal).
WIDTH = 78

#: The script cProfile (or bottleneck) runs in a fresh Python: the same kind of training.
TRAIN_SCRIPT = """\
import torch
from torch import nn

def train(steps):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        x, y = torch.randn(64, 128), torch.randint(0, 10, (64,))
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

train(200)
"""


class Net(nn.Module):
    """An encoder and a classifier head: small enough that a step takes about a millisecond."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


class Training:
    """The model, its optimizer and a few batches: ``run(n)`` trains ``n`` steps."""

    def __init__(self, device: torch.device) -> None:
        torch.manual_seed(0)
        self.device = device
        self.model = Net().to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.batches = [
            (torch.randn(32, 128, device=device), torch.randint(0, 10, (32,), device=device))
            for _ in range(4)
        ]

    def run(self, steps: int) -> None:
        for step in range(steps):
            x, y = self.batches[step % len(self.batches)]
            loss = nn.functional.cross_entropy(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()


def activities(device: torch.device) -> list[ProfilerActivity]:
    """CPU operators always; GPU kernels too on CUDA."""
    if device.type == "cuda":
        return [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    return [ProfilerActivity.CPU]


def trimmed_table(table: str, keep: tuple[str, ...], width: int = WIDTH) -> str:
    """``key_averages().table()`` with only the ``keep`` columns, if it is wider than ``width``.

    The table's first line is dashes, one run per column, so it gives each column's span.
    """
    lines = table.splitlines()
    if max(len(line) for line in lines) <= width or not lines[0].startswith("-"):
        return table
    spans = [match.span() for match in re.finditer(r"-+", lines[0])]
    header = lines[1]
    kept = [(start, end) for start, end in spans if header[start:end].strip() in keep]
    trimmed = []
    for line in lines:
        if len(line) >= spans[-1][1]:  # a row of the table: cut out the kept columns
            line = "  ".join(line[start:end] for start, end in kept)
        trimmed.append(line.rstrip())
    return "\n".join(trimmed)


def check_trace(path: Path) -> tuple[int, int]:
    """The trace file parsed as JSON: its number of events, and of those, operator events."""
    with path.open() as file:
        trace = json.load(file)
    events = trace["traceEvents"]
    # "ph": "X" is a complete event (a start and a duration): operators, kernels, Python calls.
    ops = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("aten::")]
    return len(events), len(ops)


def profile_steps(options: harness.DemoOptions, training: Training, steps: int) -> int:
    """The top ops and a Chrome trace of a few steps; returns the trace's number of events."""
    device = options.device
    harness.section(f"torch.profiler around {steps} training steps")
    training.run(2)  # warm up first: the first steps pay one-time costs a profile would show
    with profile(activities=activities(device)) as prof:
        training.run(steps)
        if options.cuda:
            torch.cuda.synchronize(device)

    sort_by = "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=8, max_name_column_width=36)
    print(f'prof.key_averages().table(sort_by="{sort_by}", row_limit=8):')
    # Cut to four columns when the terminal (or the viewer's log) is narrower than the table.
    columns = shutil.get_terminal_size((WIDTH, 24)).columns if sys.stdout.isatty() else WIDTH
    print(trimmed_table(table, ("Name", "Self CPU %", "Self CPU", "# of Calls"), columns))
    print(
        "Self CPU is the time in the op itself, without the ops it calls (CPU total has "
        "them): the rows at the top are where the steps' CPU time goes. aten::addmm and "
        "aten::mm are the Linear layers' matrix products (forward and backward); "
        "Optimizer.step is the update."
    )
    if options.cuda:
        print('on CUDA, sort_by="self_cuda_time_total" ranks the GPU kernels instead')

    fd, name = tempfile.mkstemp(prefix="torchtop-profiling-", suffix=".json")
    os.close(fd)
    trace_path = Path(name)
    prof.export_chrome_trace(str(trace_path))
    events, op_events = check_trace(trace_path)
    print(f"Chrome trace: {trace_path}")
    print(
        f"  valid JSON, {events} events, {op_events} of them operator calls: open it in "
        "https://ui.perfetto.dev (or chrome://tracing) to see each step on a timeline"
    )
    return events


def show_cprofile_of_steps(training: Training, steps: int) -> int:
    """cProfile around the steps only, in this process; returns the number of calls it saw."""
    harness.section("cProfile around the same steps: Python functions, not operators")
    profiler = cProfile.Profile()
    profiler.enable()
    training.run(steps)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).strip_dirs().sort_stats("cumulative")
    stats.print_stats(8)
    print_pstats_rows(out.getvalue())
    print(
        "cumtime counts a function with everything it calls, so the top rows are the "
        "frames every step passes through: run() itself, backward(), the modules' "
        "__call__ and Optimizer.step; tottime is the time in the function's own code"
    )
    return int(stats.total_calls)  # type: ignore[attr-defined]


def measure_overheads(
    options: harness.DemoOptions, training: Training, steps: int, events: int, calls: int
) -> list[harness.PhaseResult]:
    """The same steps with no profiler, under torch.profiler and under cProfile."""
    device = options.device
    harness.section("what profiling costs")
    repeat = 5 if options.quick else 10
    min_seconds = 0.0 if options.quick else 3.0

    def plain() -> None:
        training.run(steps)

    def with_torch_profiler() -> None:
        with profile(activities=activities(device)):
            training.run(steps)

    def with_cprofile() -> None:
        profiler = cProfile.Profile()
        profiler.enable()
        training.run(steps)
        profiler.disable()

    details = {
        "no profiler": f"{steps} steps",
        "torch.profiler": f"{events} events",
        "cProfile": f"{calls} calls",
    }
    results = []
    baseline = 0.0
    for phase, fn, description in (
        (
            "no profiler",
            plain,
            "The training steps as they are: the baseline the profilers' costs are measured "
            "against.",
        ),
        (
            "torch.profiler",
            with_torch_profiler,
            "torch.profiler records every operator call (and on a GPU every kernel) with its "
            "time and shapes. Starting it has a fixed cost and each op pays a little more: "
            "profile a few representative steps, not an epoch.",
        ),
        (
            "cProfile",
            with_cprofile,
            "cProfile hooks every Python function call and return. It sees your code and "
            "torch's Python layers but not inside the operators, and its cost grows with "
            "the number of Python calls.",
        ),
    ):
        result = harness.measure(
            phase,
            fn,
            device=device,
            repeat=repeat,
            min_seconds=min_seconds,
            description=description,
        )
        baseline = baseline or result.seconds
        overhead = result.seconds / baseline
        extra = {"overhead": round(overhead, 2), "detail": details[phase]}
        results.append(dataclasses.replace(result, extra=extra))
        print(f"{phase}: {harness.format_seconds(result.seconds)} ({overhead:.2f} times)")
        harness.pause(options)
    print(
        "part of torch.profiler's cost is fixed (starting and stopping it), part comes with "
        "every op, and building its tables afterwards costs more: profile a few "
        "representative steps, not a whole epoch"
    )
    return results


def print_pstats_rows(text: str, limit: int = 8) -> None:
    """The first ``limit`` rows of a pstats listing: calls, own time, cumulative time, name.

    pstats prints ``ncalls tottime percall cumtime percall filename:lineno(function)``; the
    two per-call columns are dropped so the names fit in ``WIDTH`` columns.
    """
    row = re.compile(r"^\s*([\d/]+)\s+([\d.]+)\s+[\d.]+\s+([\d.]+)\s+[\d.]+\s+(.*)$")
    print(f"{'ncalls':>9} {'tottime':>8} {'cumtime':>8}  function")
    shown = 0
    for line in text.splitlines():
        match = row.match(line)
        if match is None:
            continue
        calls, own, cumulative, function = match.groups()
        print(f"{calls:>9} {own:>8} {cumulative:>8}  {shorten_paths(function)}"[:WIDTH])
        shown += 1
        if shown == limit:
            break


def shorten_paths(line: str) -> str:
    """``/long/site-packages/torch/optim/sgd.py:29(__init__)`` -> ``optim/sgd.py:29(...)``."""
    return re.sub(r"(?:/[^/\s]+)*/([^/\s]+/[^/\s]+\.py)", r"\1", line)


def run_bottleneck_or_cprofile(options: harness.DemoOptions) -> None:
    """torch.utils.bottleneck on a small script if this PyTorch has it; cProfile otherwise."""
    harness.section("torch.utils.bottleneck on a small training script")
    has_bottleneck = importlib.util.find_spec("torch.utils.bottleneck") is not None
    if not has_bottleneck:
        print(
            f"torch.utils.bottleneck is not part of PyTorch {torch.__version__}: it was "
            "removed. Its first half is one command: python -m cProfile -s cumtime SCRIPT"
        )
    if options.quick:
        what = "bottleneck" if has_bottleneck else "that command"
        print(
            f"skipped with --quick: {what} starts a fresh Python, which imports torch and "
            "runs the whole script under the profiler: several seconds; run the demo without "
            "--quick to see it"
        )
        return

    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory(prefix="torchtop-profiling-") as folder:
        script = Path(folder) / "train_small.py"
        script.write_text(TRAIN_SCRIPT)
        if has_bottleneck:
            command = [sys.executable, "-m", "torch.utils.bottleneck", str(script)]
            print("$ python -m torch.utils.bottleneck train_small.py")
            try:
                start = time.perf_counter()
                proc = subprocess.run(
                    command, capture_output=True, text=True, timeout=180, env=env, cwd=folder
                )
                took = time.perf_counter() - start
                if proc.returncode == 0:
                    for line in proc.stdout.splitlines()[:40]:
                        print(shorten_paths(line)[:WIDTH])
                    print(f"(it took {took:.1f} s)")
                    return
                print(f"it failed here (exit {proc.returncode}): {proc.stderr.strip()[-300:]}")
            except subprocess.TimeoutExpired:
                print("it ran past 180 s here and was stopped")

        print("$ python -m cProfile -s cumtime train_small.py")
        command = [sys.executable, "-m", "cProfile", "-s", "cumtime", str(script)]
        try:
            start = time.perf_counter()
            proc = subprocess.run(
                command, capture_output=True, text=True, timeout=180, env=env, cwd=folder
            )
            took = time.perf_counter() - start
        except subprocess.TimeoutExpired:
            print("it ran past 180 s here and was stopped")
            return
        if proc.returncode != 0:
            print(f"it failed here (exit {proc.returncode}): {proc.stderr.strip()[-300:]}")
            return
        print_pstats_rows("\n".join(shorten_paths(line) for line in proc.stdout.splitlines()), 12)
        print(
            f"(it took {took:.1f} s) A whole-script profile is mostly start-up: `import torch` "
            "and, at the first optimizer, torch's compiler stack (torch._dynamo) being "
            "imported. Look further down for train(), or profile just the loop, as above."
        )


def trace_a_shape_error(
    options: harness.DemoOptions, training: Training
) -> tuple[harness.PhaseResult, str]:
    """Feed ``[32, 100]`` to a model whose first layer is ``Linear(128, 64)``, and trace it.

    Returns the measured phase (the failing call, caught) and the module that raised, named.
    """
    harness.section("a shape error, caught and traced to its source")
    model = training.model
    wrong_batch = torch.randn(32, 100, device=options.device)  # 100 features, not 128
    print(f"model(x) with x of shape {list(wrong_batch.shape)}; the model:\n{model}")

    def forward_wrong_shape() -> RuntimeError | None:
        try:
            model(wrong_batch)
        except RuntimeError as error:
            return error
        return None

    error = forward_wrong_shape()
    if error is None:
        raise AssertionError("the wrong-shaped batch went through")
    print(f"-> RuntimeError: {error}")

    # The traceback, outermost call first. The last frames are inside torch, where the
    # error surfaced; the one that matters is the last frame in your own code.
    frames = traceback.extract_tb(error.__traceback__)
    print("the traceback, innermost call last (paths shortened):")
    for frame in frames:
        ours = Path(frame.filename).resolve() == THIS_FILE
        where = f"{shorten_paths(frame.filename)}:{frame.lineno} in {frame.name}"
        print(f"  {'>' if ours else ' '} {where}: {(frame.line or '').strip()}"[:WIDTH])
    own = [frame for frame in frames if Path(frame.filename).resolve() == THIS_FILE]
    last_own = own[-1]
    location = f"{Path(last_own.filename).name}:{last_own.lineno}"

    # The module that raised it: the innermost frame running a Module's method has the
    # module as `self`. Its name in the model says which of several Linear layers it is.
    culprit: nn.Module | None = None
    tb = error.__traceback__
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if isinstance(candidate, nn.Module):
            culprit = candidate
        tb = tb.tb_next
    names = {id(module): name for name, module in model.named_modules()}
    culprit_name = names.get(id(culprit), "?") if culprit is not None else "?"
    del error, tb  # a traceback keeps every frame (and their tensors) alive

    print(f"the last line of your code (marked >): {location} in {last_own.name}")
    print(f"the module that raised it: model.{culprit_name} = {culprit}")
    print(
        "how to read it: F.linear computes x @ weight.T. mat1 is the input as a matrix "
        "(32 rows of 100 features) and mat2 is weight.T (128 x 64); the two inner sizes, 100 "
        "and 128, must be equal. The layer expects 128 features per sample and got 100: fix "
        "the data (or the layer's in_features), not the layer's output size."
    )

    result = harness.measure(
        "wrong shape (caught)",
        forward_wrong_shape,
        device=options.device,
        repeat=5 if options.quick else 10,
        description="A batch of 100 features into Linear(128, 64) fails in F.linear: "
        "mat1 and mat2 shapes cannot be multiplied. The last frame of your own code in the "
        "traceback, and the module it ran, say which layer and which input.",
    )
    described = f"model.{culprit_name}, {type(culprit).__name__}" if culprit else "?"
    return (
        harness.PhaseResult(result.name, result.seconds, result.peak_bytes, {"detail": location}),
        described,
    )


def conclusion(results: list[harness.PhaseResult], culprit: str) -> str:
    plain, profiled, cprofiled, wrong = results
    return (
        f"with torch.profiler the steps {harness.speed_clause(profiled, plain, 'without')} "
        f"({harness.format_seconds(profiled.seconds)} against "
        f"{harness.format_seconds(plain.seconds)}), with cProfile they "
        f"{harness.speed_clause(cprofiled, plain, 'without')}; the Chrome trace held "
        f"{profiled.extra['detail']}; the shape error was traced to "
        f"{wrong.extra['detail']} ({culprit})."
    )


def main() -> None:
    options = harness.begin(__doc__, "profiling")
    steps = 5 if options.quick else 20
    training = Training(options.device)
    events = profile_steps(options, training, steps)
    calls = show_cprofile_of_steps(training, steps)
    results = measure_overheads(options, training, steps, events, calls)
    run_bottleneck_or_cprofile(options)
    shape_error, culprit = trace_a_shape_error(options, training)
    results.append(shape_error)
    harness.print_results(
        f"profiling {steps} training steps on {options.device}",
        results,
        conclusion(results, culprit),
    )
    harness.emit_json_results(results)


if __name__ == "__main__":
    main()
