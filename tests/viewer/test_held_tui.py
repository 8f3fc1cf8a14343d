"""The view of what holds the memory (``h``): per device, the split stacked over time, one
letter per cell, and the module table (or why there is none), at 80x24."""

from __future__ import annotations

import dataclasses
import re
import shutil
import sys

import pytest
from test_ops_tui import ops_job, window
from test_tui_app import (
    HOST,
    T0,
    cpu_job,
    cuda_job,
    drained,
    hello,
    pilot_test,
    running,
    static_text,
)
from test_tui_tmux import Terminal, terminal  # noqa: F401 (the fixture)
from textual.widgets import Static

from tests.gpu.test_holders_attribution import attributed_capture
from tests.gpu.test_oom_snapshot import load
from torchtop.model import JobModel
from torchtop.model.memory import ModuleMemory
from torchtop.protocol import (
    CategoryBytes,
    DeviceHolding,
    MemoryHolders,
    MemoryStats,
    Message,
    OutOfMemory,
    PhaseBegan,
    PhaseEnded,
    Sample,
)
from torchtop.sizes import format_bytes
from torchtop.tui.app import TorchtopApp
from torchtop.tui.screens.oom import OomScreen, banner_text, held_bar
from torchtop.tui.widgets.held import (
    NO_WINDOW,
    NOT_SPLIT,
    HeldPanel,
    held_columns,
    held_view,
    stacked_rows,
)
from torchtop.tui.widgets.log import LogPanel
from torchtop.tui.widgets.memory import MemoryPanel, stack_cells

MiB = 1 << 20
GiB = 1 << 30
PARAMS = 64 * MiB


def held_job(device: str = "cpu") -> list[Message]:
    """A CPU job that trains with SGD (no state) for 15 s, then with Adam (two moments per
    parameter) for 15 s: the optimizer state appears, and allocated grows by it."""
    cuda = device.startswith("cuda")
    messages: list[Message] = [hello(cuda=cuda), PhaseBegan(T0, "SGD", 1)]
    for i in range(300):
        t = T0 + i / 10
        adam = i >= 150
        if i == 150:
            messages += [PhaseEnded(t, "SGD", 1), PhaseBegan(t, "Adam", 2)]
        state = 2 * PARAMS if adam else 0
        activations = 96 * MiB if i % 10 < 5 else 16 * MiB  # forward's peak, then the drop
        allocated = 2 * PARAMS + state + activations
        source = "cuda-allocator" if cuda else "cpu-heap"
        messages.append(
            Sample(t, HOST, [MemoryStats(device, source, allocated, allocated + 40 * MiB)])
        )
        if i % 10 == 0 and i >= 10:  # the holders, once a second from the first step
            messages.append(MemoryHolders(t, 1, [DeviceHolding(device, PARAMS, PARAMS, state)]))
    messages.append(PhaseEnded(T0 + 30, "Adam", 2))
    return messages


def _model(messages: list[Message]) -> JobModel:
    model = JobModel()
    for message in messages:
        model.apply(message)
    return model


# -- the drawing, without an app -----------------------------------------------------------------


def test_each_column_is_its_slice_s_highest_sample_split_by_the_model() -> None:
    model = _model(held_job())
    memory = model.memory["cpu"]
    columns = held_columns(memory.series, T0, T0 + 30, 30)
    # Before the first holders read: allocated unsplit ("unsplit"), beside the RSS above it.
    assert columns[0] == {"unsplit": 2 * PARAMS + 96 * MiB, "cache": 40 * MiB, "fragmentation": 0}
    sgd, adam = columns[10], columns[25]
    assert sgd is not None and adam is not None
    assert sgd["optimizer_state"] == 0 and adam["optimizer_state"] == 2 * PARAMS
    # The highest sample of each one-second slice: the forward's peak, not its drop.
    assert sgd["other_allocated"] == adam["other_allocated"] == 96 * MiB
    # The split sums to what the memory chart shows: allocated, then RSS.
    assert sum(adam.values()) == 4 * PARAMS + 96 * MiB + 40 * MiB


def test_stacked_rows_letter_each_cell_by_the_category_at_its_middle() -> None:
    split = {"parameters": 50, "gradients": 25, "optimizer_state": 0, "other_allocated": 25}
    rows = [line.plain for line in stacked_rows([split, None, {"cache": 100}], 4, 100)]
    # Bottom up: P P G A; an empty slice is blank; the axis says 0 at the bottom.
    assert [row[-3:] for row in rows] == ["A C", "G C", "P C", "P C"]
    assert rows[-1].strip().startswith("0")


def test_each_category_held_shows_in_one_cell_at_least_and_the_rest_by_share() -> None:
    # 2 MiB of parameters beside 300 MiB of activations, 32 MiB a cell: a cell still.
    split = {"parameters": 2 * MiB, "gradients": 0, "other_allocated": 300 * MiB}
    assert stack_cells(split, 10, 320 * MiB) == ["parameters"] + ["other_allocated"] * 8
    # As tall as the total, to the nearest cell; nothing held, nothing drawn.
    assert len(stack_cells({"other_allocated": 100 * MiB}, 10, 320 * MiB)) == 3
    assert stack_cells({"parameters": 0}, 10, 320 * MiB) == []
    # More categories than cells: the largest ones.
    many = {"parameters": 5, "gradients": 1, "optimizer_state": 9, "other_allocated": 7}
    assert stack_cells(many, 2, 22) == ["optimizer_state", "other_allocated"]


def test_the_view_shows_adam_s_state_appear_over_sgd_s() -> None:
    view = held_view(_model(held_job()), 76, 20).plain
    lines = view.splitlines()
    assert len(lines) <= 20 and max(len(line) for line in lines) <= 76
    assert lines[0].startswith("cpu") and "O optim 128 MiB" in lines[0] + lines[1]
    bars = [line[6:] for line in lines if re.match(r"^ *[\d.]*[0KMG]?[┤│]", line)]
    # 70 columns over 30 s: SGD's 15 s on the left, Adam's on the right.
    sgd = [b[5:30] for b in bars]
    assert "O" not in "".join(sgd)  # SGD: no state...
    assert all("O" in "".join(b[i] for b in bars) for i in range(40, 70))  # Adam: two moments
    assert set(bars[-1][5:]) == {"P"}  # parameters at the bottom, always
    assert "G" in "".join(b[5] for b in bars) and "A" in "".join(sgd)
    # The phases beneath, named; and no memory window yet, said so.
    assert "SGD" in view and "Adam" in view
    assert NO_WINDOW in view


def test_the_module_table_lists_the_window_s_modules_made_printable() -> None:
    modules = [
        ModuleMemory("encoder.layers.3.mlp", 48 * MiB, 0.41),
        ModuleMemory("decoder\x1b[2J", 12 * MiB, 0.1),
    ]
    view = held_view(_model(held_job()), 76, 20, modules).plain
    assert re.search(r"48M +41%  encoder\.layers\.3\.mlp", view), view
    assert "\x1b" not in view and "decoder" in view


def test_a_job_that_steps_no_optimizer_is_said_not_split() -> None:
    stats = MemoryStats("cpu", "cpu-heap", 200 * MiB, 300 * MiB)
    model = _model([hello(cuda=False), *(Sample(T0 + i, HOST, [stats]) for i in range(5))])
    view = held_view(model, 76, 20).plain
    assert "· not split 200 MiB" in view and NOT_SPLIT in view
    assert re.search(r"0┤ *·+$", view, re.MULTILINE), view  # the heap, drawn not split


# -- in the app ----------------------------------------------------------------------------------


def _held_text(app: TorchtopApp) -> str:
    view = app.job.query_one(HeldPanel).query_one("#held-view", Static)
    content = view.visual
    return str(getattr(content, "plain", content))


@pilot_test
async def test_h_shows_the_view_in_place_of_the_panels_and_h_again_goes_back() -> None:
    async with running(held_job()) as (app, pilot):
        body = app.job.query_one("#body")
        await pilot.press("h")
        await drained(pilot)
        assert body.has_class("held-only")
        assert (
            not app.job.query_one(MemoryPanel).display
            or not app.job.query_one(MemoryPanel).region.area
        )
        panel = app.job.query_one(HeldPanel)
        assert panel.region.height >= 18  # the whole body at 80x24
        text = _held_text(app)
        assert "P params 64.0 MiB" in text and "O optim 128 MiB" in text, text
        # It fits the panel: no line cut or wrapped, none past its last row.
        region = panel.query_one("#held-view").content_region
        assert len(text.splitlines()) <= region.height
        assert max(len(line) for line in text.splitlines()) <= region.width
        assert NO_WINDOW in text
        await pilot.press("h")
        await drained(pilot)
        assert not body.has_class("held-only")
        assert app.job.query_one(LogPanel).region.area


@pilot_test
async def test_t_and_l_take_the_view_s_place() -> None:
    async with running(ops_job(window())) as (app, pilot):
        body = app.job.query_one("#body")
        await pilot.press("h")
        await pilot.press("t")
        await pilot.pause()
        assert body.has_class("ops-only") and not body.has_class("held-only")
        await pilot.press("h")
        assert body.has_class("held-only") and not body.has_class("ops-only")
        await pilot.press("l")
        assert body.has_class("log-only") and not body.has_class("held-only")


@pilot_test
async def test_the_palette_and_the_help_offer_the_view() -> None:
    async with running(cpu_job()) as (app, _pilot):
        commands = {action.title: action for action, _ in app.palette_commands()}
        assert "Held" in commands and commands["Held"].keys == "h"
        assert "what holds memory" in commands["Held"].help
        keys = {action.keys: action.help for action in app.actions()}
        assert keys["h"].startswith("what holds memory")


# -- the OOM screen's split ----------------------------------------------------------------------


def _split_capture() -> OutOfMemory:
    """An OOM of the recorded H200 snapshot whose blocks the agent attributed by address to
    the optimizer's parameters, gradients and state (``cuda_snapshot_holders.json``)."""
    capture = attributed_capture(load("holders"))
    return OutOfMemory(**{**capture.__dict__, "t": T0 + 29.5, "message": "CUDA out of memory"})


def test_the_oom_banner_draws_the_split_as_a_bar_with_each_category_s_bytes() -> None:
    capture = _split_capture()
    split = {c.category: c.bytes for c in capture.by_category}
    assert sum(split.values()) == capture.allocated_bytes
    lines = [line.plain for line in held_bar(capture, 80)]
    assert 1 <= len(lines) <= 2 and all(len(line) <= 80 for line in lines)
    cells = lines[0].split()[1]
    assert re.fullmatch(r"P*G*O*A*", cells) and len(cells) == 26, lines  # 80 // 3 cells
    key = " ".join(lines)
    for category, (letter, label) in {
        "parameters": ("P", "params"),
        "gradients": ("G", "grads"),
        "optimizer_state": ("O", "optim"),
        "other_allocated": ("A", "other"),
    }.items():
        if split[category]:
            share = f"{split[category] / capture.allocated_bytes:.0%}"
            assert f"{letter} {label} {format_bytes(split[category])} {share}" in key, key
    # The verdict leaves the split to the bar; without a split it says it in words.
    model = _model([*cuda_job(), capture])
    entry = model.captures.latest
    assert entry is not None
    banner = banner_text(entry, model, width=80).plain
    assert "Held by" not in banner and lines[0] in banner
    bare = dataclasses.replace(capture, by_category=[])
    assert held_bar(bare) == []


def test_a_category_the_viewer_does_not_know_is_shown_printable() -> None:
    capture = dataclasses.replace(
        _split_capture(),
        by_category=[CategoryBytes("parameters", 3 * GiB), CategoryBytes("\x1b[2Jx", GiB)],
    )
    text = " ".join(line.plain for line in held_bar(capture))
    assert "\x1b" not in text and "? \\x1b[2Jx 1.00 GiB 25%" in text, text


@pilot_test
async def test_the_oom_screen_shows_the_split_at_80x24() -> None:
    capture = _split_capture()
    async with running([*cuda_job(), capture]) as (app, pilot):
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, OomScreen)
        banner = screen.query_one("#oom-banner", Static)
        text = static_text(banner)
        assert re.search(r" held [PGOA]{20,}", text), text
        # The whole banner shows: none of its lines is cut off at the bottom.
        assert banner.region.height >= len(text.rstrip("\n").splitlines())
        assert screen.query_one("#oom-middle").region.height >= 5


# -- the real viewer in tmux, on a real CPU job --------------------------------------------------


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_h_on_the_holders_demo_shows_the_split_move_at_80_by_24(
    terminal: Terminal,  # noqa: F811
) -> None:
    """``torchtop demo holders --quick`` in the viewer: ``h`` shows the split of the demo's
    CPU memory, one letter per cell; the optimizer state appears when Adam takes over, to the
    byte the demo measures (2 x the 2.01 MiB of parameters)."""
    command = f"{sys.executable} -m torchtop demo holders --quick; echo EXIT=$?"
    terminal.keys(command, "Enter")
    terminal.wait_for(lambda s: "running" in s and "Memory · cpu" in s, timeout=120)
    terminal.keys("h")
    sgd = terminal.wait_for(
        lambda s: "What holds memory" in s and "P params 2.01 MiB" in s, timeout=120
    )
    assert "G grads 2.01 MiB" in sgd and NO_WINDOW in sgd, sgd
    adam = terminal.wait_for(lambda s: "O optim 4.02 MiB" in s, timeout=120)
    rows = adam.splitlines()
    assert len(rows) <= 24 and max(len(row) for row in rows) <= 80
    # The stacked bars: the y axis, parameters along the bottom row, the state above them.
    bottom = next(row for row in rows if re.match(r"^ +0┤", row))
    assert "PPPP" in bottom, adam
    assert any("O" in row.split("┤" if "┤" in row else "│", 1)[-1] for row in rows), adam
    done = terminal.wait_for(lambda s: "ended · exit 0" in s, timeout=180)
    assert "SGD" in done and "Adam" in done, done  # the phases beneath the bars
    terminal.keys("h")
    terminal.wait_for(lambda s: "What holds memory" not in s and "Memory · cpu" in s)
    terminal.keys("q")
    assert "EXIT=0\n" in terminal.wait_for(lambda s: re.search(r"EXIT=\d+\n", s), timeout=15)


def _devices_job(n: int) -> list[Message]:
    """A job on ``n`` GPUs, each holding parameters, gradients and Adam's state."""
    messages: list[Message] = [hello(cuda=True)]
    for i in range(100):
        t = T0 + i / 10
        stats = [
            MemoryStats(f"cuda:{d}", "cuda-allocator", 5 * GiB, 6 * GiB, inactive_split_bytes=GiB)
            for d in range(n)
        ]
        messages.append(Sample(t, HOST, stats))
        if i % 10 == 5:
            held = [DeviceHolding(f"cuda:{d}", GiB, GiB, 2 * GiB) for d in range(n)]
            messages.append(MemoryHolders(t, 1, held))
    return messages


def test_two_gpus_each_get_their_bars_and_eight_are_named_past_what_fits() -> None:
    two = held_view(_model(_devices_job(2)), 76, 20).plain.splitlines()
    assert len(two) <= 20
    heads = [line for line in two if line.startswith("cuda:")]
    assert [h.split()[0] for h in heads] == ["cuda:0", "cuda:1"], two
    # Each device's bars, from its own zero: parameters at the bottom, fragmentation on top.
    zeros = [line for line in two if re.match(r"^ +0┤", line)]
    assert len(zeros) == 2 and all(line.rstrip().endswith("P") for line in zeros), two
    tops = [line for line in two if re.match(r"^ +6\.0G┤", line)]
    assert len(tops) == 2 and all(line.rstrip().endswith("F") for line in tops), two
    eight = held_view(_model(_devices_job(8)), 76, 20).plain
    assert re.search(r"also cuda:\d, .*cuda:7 \(a taller terminal shows them\)", eight), eight
    assert len(eight.splitlines()) <= 20
