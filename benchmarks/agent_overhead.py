"""The agent's cost on training step time: agent on against off, side by side in one run.

Each model trains in one process through alternating quarter-second blocks: a block with the
agent's sampler paused and its step and DataLoader hooks removed (off), then a block with the
agent sampling at its default settings and the hooks in (on), and so on, with a viewer process
attached and reading all along. Short alternating blocks spread machine noise evenly over both
arms; the time paused does not count in the agent's schedules (its ticks, frames, op windows and
reads of what holds the memory go on in the "on" blocks as densely as in a job's own time). Each
step takes its batch from a DataLoader and ends in ``optimizer.step()``, so the hooks run every
step. The result is the ratio of the median step times (on / off), for a small MLP and for a
model made of many tiny ops (where the per-step work is smallest and any cost of the agent shows
most).

The "on" arm samples op timings at the default settings: a torch.profiler window of two steps,
spaced so that the windows cost at most the agent's default budget (0.5%) of the time. A
median hides a rare slow step, so the ratio of the mean step times is given too (it carries the
windows' amortized cost), with its 95% interval over the pairs (on a shared VM the steps slow
down by half for tenths of a second at a time, in either arm, and the mean moves by a point or
more with where those spells fall), and so is what one window cost on its own: starting and
stopping the profiler in the training thread, and the whole (those, the profiled steps'
slowdown, and reading the window). The agent's first window, which opens as soon as a job
steps, runs before the blocks: once a job, it is no part of the steady state they measure.

    python -m benchmarks.agent_overhead            # about 6 minutes
    python -m benchmarks.agent_overhead --quick    # a smoke run
    python -m benchmarks.agent_overhead --hooks-only  # the sampler on in both arms: the
                                                     # step and DataLoader hooks' share alone
    python -m benchmarks.agent_overhead --threads default  # torch's own thread count
    python -m benchmarks.agent_overhead --hook-parts  # the sampler paused in both arms: each
                                                     # part of the hooks alone, then all
    python -m benchmarks.agent_overhead --aa  # no agent in either arm: the noise floor, to
                                              # read a run of the same hour against

Each model is measured in three fresh processes (``--processes``), the pairs of blocks shared
among them, and the figures given are the medians across the processes. Within one process the
pairs agree closely (the 95% interval of their median is a few tenths of a percent wide), yet on
a shared VM one process's arms can differ by several percent for reasons of the process alone
(where its memory and threads landed): one process gave the tiny ops 0.951 (95% 0.947 to 0.952),
the next two 1.009 and 1.007. The spread across the processes is printed with the medians.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, SequentialSampler

import torchtop
from torchtop.agent import core
from torchtop.agent.steps import HOOK_S
from torchtop.agent.threads import agent_cpu_s

T = TypeVar("T")


def mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = nn.Sequential(
        nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )
    return model, torch.randn(128, 512), torch.randint(0, 10, (128,))


def tiny_ops() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    layers: list[nn.Module] = []
    for _ in range(48):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(16, 10))
    return model, torch.randn(8, 16), torch.randint(0, 10, (8,))


#: Seconds per block, and pairs of blocks per model: 40 s an arm. On a shared VM the machine's
#: speed wanders over seconds, and a pair of blocks is as fair as its blocks are short: with
#: one-second blocks, the paired median of an A/A run (both arms the same, no agent) strayed
#: by 1.4% (MLP 1.0%) from one choice of blocks to the next, with quarter-second blocks by 0.4%
#: (0.3%).
BLOCK_S = 0.25
DEFAULT_ROUNDS = 160

#: A model's builder: the model, a batch's inputs and its targets.
Build = Callable[[], tuple[nn.Module, torch.Tensor, torch.Tensor]]

#: The models by name, for ``--model``.
MODELS = {"mlp": mlp, "tiny-ops": tiny_ops}


class Batches(Dataset):
    """``x`` and ``y`` repeated, indexed a whole batch at a time (no per-sample collation)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, repeats: int = 64) -> None:
        self.x = x.repeat(repeats, *([1] * (x.dim() - 1)))
        self.y = y.repeat(repeats)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def make_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = Batches(x, y)
    sampler = BatchSampler(SequentialSampler(data), batch_size=len(y), drop_last=True)
    loader = DataLoader(data, sampler=sampler, batch_size=None)
    batches = iter(loader)

    def step() -> None:
        nonlocal batches
        try:
            bx, by = next(batches)
        except StopIteration:  # a new epoch
            batches = iter(loader)
            bx, by = next(batches)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(bx), by).backward()
        opt.step()

    return step


def warmed_step(
    build: Build,
) -> Callable[[], None]:
    """The model's training step (seeded), run for a second first to warm up."""
    torch.manual_seed(0)
    step = make_step(*build())
    block(step, 1.0)
    return step


def block(step: Callable[[], None], seconds: float) -> list[float]:
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def attach_viewer(address: str) -> subprocess.Popen[bytes]:
    """A separate process that reads everything the agent sends, as the viewer does."""
    code = (
        "from torchtop.streams.feed import AgentFeed\n"
        f"AgentFeed(address={address!r}).start().join()\n"
    )
    return subprocess.Popen([sys.executable, "-c", code])


def alternating(
    agent: core.Agent,
    run_block: Callable[[], list[float]],
    rounds: int,
    hooks_only: bool = False,
    blocks: list[tuple[list[float], list[float]]] | None = None,
) -> tuple[list[float], list[float], list[float]]:
    """``rounds`` pairs of blocks, one with the agent off and one with it on: the step times of
    each arm, and each pair's ratio of medians. The "off" blocks pause the sampler and remove
    the hooks, so the arms differ only by the agent's work (hooks, sampling, encoding,
    serving), not by process start-up. Every other pair runs its "on" block first (off on, on
    off, off on, ...): a machine that speeds up or slows down within a pair, and whatever one
    block leaves to the next (a sampler tick due, caches), fall on both arms alike. ``blocks``:
    each pair's step times (on, off) are added to it."""
    off: list[float] = []
    on: list[float] = []
    pair_ratios: list[float] = []
    agent.self_measured = []  # type: ignore[attr-defined]
    agent.hooks_measured = []  # type: ignore[attr-defined]

    def off_block() -> list[float]:
        # The pause leaves the agent's schedules where they were (its ticks, frames and op
        # windows go on in the "on" blocks as if there had been no "off" block in between),
        # and so do the hooks' reads of what holds the memory.
        if not hooks_only:
            agent.sampler.pause()
        agent.training.remove()  # not put back by the sampler's ticks in the block
        times = run_block()
        agent.training.reinstall()
        agent.sampler.resume()
        return times

    def on_block() -> list[float]:
        cpu_before, hooks_before, began = agent_cpu_s(), HOOK_S[0], time.perf_counter()
        times = run_block()
        cpu_after, hooks_after, ended = agent_cpu_s(), HOOK_S[0], time.perf_counter()
        if cpu_before is not None and cpu_after is not None:
            # What the agent's threads used in the "on" block, as it measures itself.
            agent.self_measured.append((cpu_after - cpu_before) / (ended - began))  # type: ignore[attr-defined]
        # And what its hooks took of the training thread's time, as they measure themselves.
        agent.hooks_measured.append((hooks_after - hooks_before) / (ended - began))  # type: ignore[attr-defined]
        return times

    for i in range(rounds):
        if i % 2 == 0:
            off_times = off_block()
            on_times = on_block()
        else:
            on_times = on_block()
            off_times = off_block()
        off += off_times
        on += on_times
        pair_ratios.append(statistics.median(on_times) / statistics.median(off_times))
        if blocks is not None:
            blocks.append((on_times, off_times))
    return off, on, pair_ratios


def bootstrap95(
    items: Sequence[T], statistic: Callable[[list[T]], float], draws: int = 2000
) -> tuple[float, float]:
    """A 95% bootstrap interval for ``statistic`` of ``items`` (the items drawn again with
    replacement, ``draws`` times; seeded, so that a run's figures can be read again)."""
    rng = random.Random(0)
    values = sorted(statistic(rng.choices(items, k=len(items))) for _ in range(draws))
    return values[int(0.025 * draws)], values[int(0.975 * draws) - 1]


def interval95(values: list[float]) -> tuple[float, float]:
    """A 95% bootstrap interval for the median of ``values`` (the pairs' ratios)."""
    return bootstrap95(values, statistics.median)


def mean_interval95(blocks: list[tuple[list[float], list[float]]]) -> tuple[float, float]:
    """A 95% bootstrap interval for the mean ratio (on / off) of the pairs of blocks ``blocks``
    (each pair's step times, on and off), the pairs drawn again. On a shared VM the steps slow
    down by half for tenths of a second at a time, in either arm: the mean moves by a point or
    more with where those spells fall, and this says how far."""
    sums = [(math.fsum(on), len(on), math.fsum(off), len(off)) for on, off in blocks]

    def mean_ratio(drawn: list[tuple[float, int, float, int]]) -> float:
        on_s, on_n, off_s, off_n = (sum(column) for column in zip(*drawn, strict=True))
        return (on_s / on_n) / (off_s / off_n)

    return bootstrap95(sums, mean_ratio)


def summarize(
    name: str,
    agent: core.Agent,
    off: list[float],
    on: list[float],
    pair_ratios: list[float],
    on_seconds: float,
    first: int = 0,
    blocks: list[tuple[list[float], list[float]]] | None = None,
) -> dict[str, float]:
    """The arms' figures (``on_seconds``: how long the agent ran; the op windows after the
    first ``first``; ``blocks``: each pair's step times, for the mean ratio's interval),
    printed and returned."""
    rounds = len(pair_ratios)
    ratio = statistics.median(on) / statistics.median(off)
    low, high = interval95(pair_ratios)
    mean_low, mean_high = mean_interval95(blocks) if blocks else (math.nan, math.nan)
    costs = list(agent.ops.costs)[first:] if agent.ops is not None else []
    result = {
        "model": name,
        "median_step_off_ms": statistics.median(off) * 1e3,
        "median_step_on_ms": statistics.median(on) * 1e3,
        "steps_off": len(off),
        "steps_on": len(on),
        "ratio": ratio,
        "median_pair_ratio": statistics.median(pair_ratios),
        # Where the paired median could lie, given how much the pairs vary (95%).
        "median_pair_ratio_low": low,
        "median_pair_ratio_high": high,
        "mean_ratio": statistics.fmean(on) / statistics.fmean(off),
        # Where the mean ratio could lie, given how much the pairs vary (95%).
        "mean_ratio_low": mean_low,
        "mean_ratio_high": mean_high,
        "op_windows": len(costs),
        "window_start_ms": _median_ms([c[0] for c in costs]),
        "window_stop_ms": _median_ms([c[1] for c in costs]),
        "window_cost_ms": _median_ms([c[2] for c in costs]),
        # The windows' measured cost (on the job's own steps) against the time the agent ran
        # (the "on" blocks; paused time does not count toward the spacing): the budget
        # (``--ops-budget``, 0.5% by default) holds when this does.
        "windows_share": sum(c[2] for c in costs) / on_seconds,
        "on_seconds": on_seconds,
        # The agent's threads' CPU in the "on" blocks, as the agent measures its own cost
        # (its threads' CPU clocks), and its sampling interval at the end (its budget may
        # have slowed it).
        "self_measured_share": statistics.median(getattr(agent, "self_measured", []) or [0.0]),
        # The hooks' own time in the training thread, as a share of the "on" blocks.
        "hooks_measured_share": statistics.median(getattr(agent, "hooks_measured", []) or [0.0]),
        "interval_s": agent.sampler.interval_s,
    }
    if isinstance(agent, _NoAgent):  # an A/A run: no windows, no agent to speak of
        print(
            f"{name:10s} A/A: off {result['median_step_off_ms']:8.3f} ms"
            f"  off too {result['median_step_on_ms']:8.3f} ms  ratio {ratio:.4f}  (median of"
            f" {rounds} paired blocks {result['median_pair_ratio']:.4f}, 95% {low:.4f} to"
            f" {high:.4f}); mean ratio {result['mean_ratio']:.4f} (95% {mean_low:.4f} to"
            f" {mean_high:.4f})",
            flush=True,
        )
        return result
    print(
        f"{name:10s} off {result['median_step_off_ms']:8.3f} ms"
        f"  on {result['median_step_on_ms']:8.3f} ms"
        f"  ratio {ratio:.4f}  (median of {rounds} paired blocks {result['median_pair_ratio']:.4f},"
        f" 95% {low:.4f} to {high:.4f}; {len(off)} / {len(on)} steps)\n"
        f"{'':10s} mean ratio {result['mean_ratio']:.4f} (95% {mean_low:.4f} to {mean_high:.4f});"
        f" {len(costs)} op windows, one costs"
        f" {result['window_cost_ms']:.2f} ms (profiler start {result['window_start_ms']:.2f} ms,"
        f" stop {result['window_stop_ms']:.2f} ms); the windows cost"
        f" {result['windows_share']:.2%} of the run\n"
        f"{'':10s} the agent's threads measured {result['self_measured_share']:.2%} of a core and"
        f" its hooks {result['hooks_measured_share']:.2%} of the step time in the on blocks"
        f" ({result['self_measured_share'] + result['hooks_measured_share']:.2%} in all, as the"
        f" agent's one-second figure adds them); it samples every {result['interval_s']:g} s",
        flush=True,
    )
    return result


def first_window(agent: core.Agent, step: Callable[[], None], limit_s: float = 15.0) -> int:
    """Steps with the agent on until its first op window has been read and priced: that
    window opens as soon as a job steps, so that its op timings show at once. Once a job, it
    is no part of the steady state the blocks measure (in a process of 14 pairs it would be
    half the windows). Returns how many windows it took, to leave out of the figures."""
    if agent.ops is None:
        return 0
    deadline = time.monotonic() + limit_s
    while not agent.ops.costs and time.monotonic() < deadline:
        block(step, 0.5)
    return len(agent.ops.costs)


def measure(
    name: str,
    build: Build,
    rounds: int,
    seconds: float,
    hooks_only: bool = False,
    ops: bool = True,
    settings: dict[str, float] | None = None,
    self_measure: bool = True,
    first_apart: bool = True,
) -> dict[str, float]:
    """The model's figures; ``self_measure``: then the agent's own measure of its cost too
    (:func:`self_measured`, at least 48 s more); ``first_apart``: the first op window runs
    before the blocks (:func:`first_window`)."""
    step = warmed_step(build)
    # One agent and one viewer for the whole run.
    # The agent's own pauses (its measured cost) would fall in the "on" blocks: off here, and
    # measured on their own in :func:`self_measured`.
    agent = core.start(ops=ops, measure_cost=False, **(settings or {}))
    viewer = attach_viewer(agent.info.address)
    time.sleep(1.0)  # the viewer connects and takes the history replay
    try:
        first = first_window(agent, step) if first_apart else 0
        blocks: list[tuple[list[float], list[float]]] = []
        off, on, pair_ratios = alternating(
            agent, lambda: block(step, seconds), rounds, hooks_only, blocks
        )
    finally:
        viewer.kill()
        viewer.wait()
        torchtop.stop()
    result = summarize(name, agent, off, on, pair_ratios, rounds * seconds, first, blocks)
    if self_measure:
        result.update(self_measured(step, rounds * seconds, ops, settings))
        print(f"{'':10s} {against_benchmark(result)}", flush=True)
    return result


def against_benchmark(result: dict[str, Any]) -> str:
    """The agent's figure (what it shows: the pauses' measure where they agreed, else the
    ticks'; its hooks and op windows added) beside the benchmark's: the mean ratio's excess,
    which carries the same rare slow steps the agent's means do, and the paired median's."""
    shown = result["self_measured_step_share"]
    if math.isnan(shown):
        shown = result["self_measured_ticks_step_share"]
    mean, median = result["mean_ratio"] - 1, result["median_pair_ratio"] - 1

    def times(excess: float) -> str:
        return f"{shown / excess:.2g}x" if excess > 0 else "n/a: no excess"

    return (
        f"the agent's figure {shown:.2%} against the benchmark's mean excess {mean:.2%}"
        f" ({times(mean)}) and paired median excess {median:.2%} ({times(median)})"
    )


class _Still:
    """An A/A run's stand-in for the sampler and the hooks: pausing, resuming, removing and
    reinstalling change nothing."""

    interval_s = math.nan

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def remove(self) -> None:
        pass

    def reinstall(self) -> None:
        pass


class _NoAgent:
    """An A/A run's stand-in for the agent: no agent at all, in either arm."""

    ops = None

    def __init__(self) -> None:
        self.sampler = self.training = _Still()


def noise_floor(
    name: str,
    build: Build,
    rounds: int,
    seconds: float,
) -> dict[str, float]:
    """``--aa``: the model's figures with no agent in either arm, the blocks cut and paired as
    in a measurement: how far from 1 this machine's noise puts them now, to read the agent's
    figures of the same hour against."""
    step = warmed_step(build)
    blocks: list[tuple[list[float], list[float]]] = []
    agent = cast(core.Agent, _NoAgent())
    off, on, pair_ratios = alternating(agent, lambda: block(step, seconds), rounds, False, blocks)
    return summarize(name, agent, off, on, pair_ratios, rounds * seconds, 0, blocks)


def self_measured(
    step: Callable[[], None], seconds: float, ops: bool, settings: dict[str, float] | None = None
) -> dict[str, float]:
    """The agent's own measure of its cost on the steps (it pauses its sampler now and then and
    compares the steps in the pauses with those around them, and adds its hooks' own time,
    which the pauses leave in; until the pauses agree, the steps its ticks overlapped against
    the others), over ``seconds`` of steps with the agent on throughout: what the viewer's
    header and the report say, beside the benchmark's ratio."""
    agent = core.start(ops=ops, measure_cost=True, cost_pause_every_s=6.0, **(settings or {}))
    viewer = attach_viewer(agent.info.address)
    try:
        hooks_before, began = HOOK_S[0], time.perf_counter()
        block(step, max(seconds, 8 * 6.0))
        hooks = (HOOK_S[0] - hooks_before) / (time.perf_counter() - began)
        time.sleep(1.5)  # the sampler compares the last pause's after-block
        paused = agent.paused_steps
        measured = paused.measured() if paused is not None else None
        compared = paused.compared if paused is not None else 0
        ticked = agent.ticked_steps.measured(fresh=True) if agent.ticked_steps else None
        windows = (agent.ops.windows_share() if agent.ops is not None else None) or 0.0
    finally:
        viewer.kill()
        viewer.wait()
        torchtop.stop()
    pauses = measured.step_share if measured is not None else float("nan")
    pairs = measured.pairs if measured is not None else 0
    # The hooks and the op windows measure themselves; each measure of the rest adds them.
    added = hooks + windows
    if measured is not None:
        said = (
            f"the agent measured itself at {pauses + added:.2%} of step time: its pauses"
            f" {pauses:.2%} over {pairs} (paused against around), its hooks {hooks:.2%},"
            f" its op windows {windows:.2%}"
        )
    else:  # the agent then shows its threads' CPU and its hooks' time, as above
        said = (
            f"the agent's pauses said nothing ({compared} comparisons, too far apart to say);"
            f" its hooks {hooks:.2%} of step time, its op windows {windows:.2%}"
        )
    ticks = ticked.step_share if ticked is not None else float("nan")
    if ticked is not None:  # what the agent shows until its pauses agree
        said += (
            f"\n{'':10s} its ticks measured {ticks:.2%} of step time on the {ticked.pairs}"
            f" steps they overlapped: {ticks + added:.2%} with its hooks and op windows"
        )
    else:
        said += f"\n{'':10s} its ticks said nothing (too few steps, or too far apart to say)"
    print(f"{'':10s} {said}", flush=True)
    return {
        "self_measured_ticks_share": ticks,
        "self_measured_ticks_steps": ticked.pairs if ticked is not None else 0,
        "self_measured_step_share": pauses + added,
        "self_measured_ticks_step_share": ticks + added,
        "self_measured_pauses_share": pauses,
        "self_measured_hooks_share": hooks,
        "self_measured_windows_share": windows,
        "self_measured_pairs": pairs,
    }


#: The parts of the training thread's hooks that ``--hook-parts`` measures one at a time.
HOOK_PARTS = ("optimizer", "dataloader", "backward")


def hook_parts(
    name: str,
    build: Build,
    rounds: int,
    seconds: float,
) -> dict[str, object]:
    """Each part of the hooks alone, then all of them, in against out with the sampler paused
    in both arms: what the training thread pays for the hooks themselves, in the job's own
    steps (a hook costs several times more there, its code and data cold, than timed alone)."""
    step = warmed_step(build)
    agent = core.start(ops=False, measure_cost=False)
    agent.sampler.pause()
    training = agent.training
    result: dict[str, object] = {"model": name}
    try:
        for part in (*HOOK_PARTS, "all"):
            off: list[float] = []
            on: list[float] = []
            pairs: list[float] = []
            for _ in range(rounds):
                training.remove()
                off_block = block(step, seconds)
                training.reinstall(None if part == "all" else (part,))
                on_block = block(step, seconds)
                training.drain()  # the blocks' events, outside the timed blocks
                off += off_block
                on += on_block
                pairs.append(statistics.median(on_block) / statistics.median(off_block))
            ratio = statistics.median(on) / statistics.median(off)
            result[part] = {"ratio": ratio, "median_pair_ratio": statistics.median(pairs)}
            print(
                f"{name:10s} hooks: {part:10s} ratio {ratio:.4f}"
                f"  (median of {rounds} paired blocks {statistics.median(pairs):.4f})",
                flush=True,
            )
    finally:
        torchtop.stop()
    return result


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else float("nan")


#: The figures given across processes, as the median of each process's.
ACROSS = ("median_pair_ratio", "ratio", "mean_ratio", "self_measured_share", "hooks_measured_share")


def across_processes(args: argparse.Namespace) -> None:
    """Each model measured in ``args.processes`` fresh processes (this script with
    ``--processes 1``), the rounds shared among them; the agent's own measure in the first only.
    Prints each process's figures as it ends, then the medians across the processes."""
    rounds = args.rounds or (3 if args.quick else DEFAULT_ROUNDS)
    share = [
        rounds // args.processes + (k < rounds % args.processes) for k in range(args.processes)
    ]
    passed = ["--threads", str(args.threads), "--block", str(args.block)]
    flags = (("--quick", args.quick), ("--hooks-only", args.hooks_only),
             ("--no-ops", args.no_ops), ("--aa", args.aa))  # fmt: skip
    passed += [flag for flag, on in flags if on]
    if args.interval is not None:
        passed += ["--interval", str(args.interval)]
    if args.ops_budget is not None:
        passed += ["--ops-budget", str(args.ops_budget)]
    first_self_measures = not args.no_self_measure and not args.aa
    results = []
    for name in [m for m in MODELS if args.model in (None, m)]:
        runs: list[dict[str, Any]] = []
        for k, pairs in enumerate(share):
            if pairs == 0:
                continue
            command = [
                sys.executable, "-m", "benchmarks.agent_overhead", "--processes", "1",
                "--model", name, "--rounds", str(pairs), "--json", *passed,
                *([] if k == 0 and first_self_measures else ["--no-self-measure"]),
            ]  # fmt: skip
            print(f"{name}: process {k + 1} of {len(share)}, {pairs} pairs of blocks", flush=True)
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            text, _, found = done.stdout.partition("\n[\n")
            print("\n".join(line for line in text.splitlines() if line.strip()), flush=True)
            try:
                result, _ = json.JSONDecoder().raw_decode("[\n" + found)
                runs.append(result[0])
            except (ValueError, IndexError):
                sys.exit(f"process {k + 1} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
        summary: dict[str, Any] = {"model": name, "processes": runs}
        for key in ACROSS:
            values = [float(r[key]) for r in runs if key in r]
            if values:
                summary[key] = statistics.median(values)
        # The op windows of all the processes' on blocks together: at the default budget a
        # process's blocks hold about one window after the first, or none.
        windows = sum(int(r["op_windows"]) for r in runs)
        seconds = [r["on_seconds"] for r in runs]
        costs = sum(float(r["windows_share"]) * s for r, s in zip(runs, seconds, strict=True))
        summary["windows_share"] = costs / sum(seconds)
        if runs and "self_measured_step_share" in runs[0]:
            # The agent measured itself in the first process: beside the medians across all.
            across = {k: summary[k] for k in ("mean_ratio", "median_pair_ratio")}
            print(f"{name:10s} across: {against_benchmark({**runs[0], **across})}", flush=True)
        shown = " · ".join(f"{r['median_pair_ratio']:.4f}" for r in runs)
        means = " · ".join(f"{r['mean_ratio']:.4f}" for r in runs)
        print(
            f"{name:10s} across {len(runs)} processes: paired median"
            f" {summary['median_pair_ratio']:.4f} ({shown});"
            f" mean ratio {summary['mean_ratio']:.4f} ({means}); {windows} op windows after"
            f" the first, {summary['windows_share']:.2%} of the on blocks' time",
            flush=True,
        )
        results.append(summary)
    if args.json:
        print(json.dumps(results, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the results as JSON at the end")
    parser.add_argument(
        "--hooks-only",
        action="store_true",
        help="keep the sampler running in both arms: measure the step and DataLoader hooks",
    )
    parser.add_argument("--no-ops", action="store_true", help="no op-timing windows in the on arm")
    parser.add_argument(
        "--aa",
        action="store_true",
        help="no agent in either arm (A/A): where this machine's noise puts the figures now",
    )
    parser.add_argument(
        "--hook-parts",
        action="store_true",
        help="the sampler paused in both arms: each part of the hooks (optimizer, DataLoader,"
        " backward) in against out alone, then all of them",
    )
    parser.add_argument("--model", choices=("mlp", "tiny-ops"), help="measure this model only")
    parser.add_argument(
        "--rounds", type=int, help=f"paired blocks per model (default {DEFAULT_ROUNDS})"
    )
    parser.add_argument(
        "--block",
        type=float,
        default=BLOCK_S,
        help=f"seconds per block (default {BLOCK_S:g})",
    )
    parser.add_argument(
        "--threads",
        default="1",
        help="torch's intra-op threads: a number, or 'default' (one per core, as a user's CPU "
        "job has); 1 leaves the agent a core of its own",
    )
    parser.add_argument(
        "--interval",
        type=float,
        help="the agent's sampling interval in seconds (default: the agent's own default)",
    )
    parser.add_argument(
        "--ops-budget",
        type=float,
        help="the op windows' share of the time, in percent (default: the agent's own default)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=3,
        help="fresh processes per model, the pairs of blocks shared among them (default 3)",
    )
    parser.add_argument(
        "--no-self-measure",
        action="store_true",
        help="leave out the agent's own measure of its cost (48 s a model)",
    )
    args = parser.parse_args()
    if args.processes > 1 and not args.hook_parts:
        across_processes(args)
        return
    settings: dict[str, float] = {}
    if args.interval is not None:
        settings["interval_s"] = args.interval
    if args.ops_budget is not None:
        settings["ops_budget"] = args.ops_budget / 100
    if args.threads != "default":
        torch.set_num_threads(int(args.threads))
    print(f"torch threads: {torch.get_num_threads()} ({args.threads})", flush=True)
    rounds, seconds = (3, 0.5) if args.quick else (DEFAULT_ROUNDS, args.block)
    if args.rounds:
        rounds = args.rounds
    models = [(name, build) for name, build in MODELS.items() if args.model in (None, name)]
    results: list[dict[str, object]]
    if args.hook_parts:
        results = [hook_parts(name, build, rounds, seconds) for name, build in models]
    elif args.aa:
        results = [dict(noise_floor(name, build, rounds, seconds)) for name, build in models]
    else:
        results = [
            dict(
                measure(
                    name,
                    build,
                    rounds,
                    seconds,
                    args.hooks_only,
                    not args.no_ops,
                    settings,
                    self_measure=not args.no_self_measure,
                )
            )
            for name, build in models
        ]
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
