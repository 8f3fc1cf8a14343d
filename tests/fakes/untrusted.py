"""A job's stream with hostile text in every string: one message of every kind, as a recording.

:func:`job_stream` is one plausible job (a hello, samples, GPU readings, phases, marks, log
lines, steps, loaders, an op window, an out-of-memory failure and a snapshot, a hang's stack,
an exit) whose numbers hang together; :func:`with_text` puts a string of the caller's into
every ``str`` inside it, the same original always getting the same replacement so that a
device's id still joins its memory and its name.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchtop.protocol import (
    MESSAGE_TYPES,
    AgentStats,
    AllocationSite,
    ClientHello,
    CollectiveEntry,
    CollectivesSeen,
    DeviceHolding,
    DeviceInfo,
    Dropped,
    GpuProcess,
    GpuSample,
    GpuStats,
    Hello,
    HostStats,
    JobExited,
    LoaderInfo,
    LoaderStats,
    LogLine,
    Marked,
    MatmulDtype,
    MemoryHolders,
    MemorySnapshotTaken,
    MemoryStats,
    Message,
    ModuleBytes,
    OomResumed,
    OpStat,
    OpsWindow,
    OutOfMemory,
    PhaseBegan,
    PhaseEnded,
    ProbeStatus,
    Refused,
    RelayHello,
    Request,
    Sample,
    StackFrame,
    StackSampled,
    StepStats,
    WorkerStats,
    encode,
)

T0 = 1_700_000_000.0
GiB = 1 << 30

#: What a hostile string does on a terminal that obeys it: set the window title, write the
#: clipboard, clear the screen. None of them may reach the terminal from torchtop's output.
TITLE = "\x1b]0;PWNED\x07"
CLIPBOARD = "\x1b]52;c;cm0gLXJmIH4K\x07"
CLEAR = "\x1b[2J"
ATTACKS = (TITLE, CLIPBOARD, CLEAR)
#: The same, as the bytes a terminal would receive.
ATTACK_BYTES = (*(a.encode() for a in ATTACKS), b"\x1b]0;", b"\x1b]52;", b"\x1b[2J")
#: Rich markup that must print as it is: a closing tag that opens nothing (a ``MarkupError``
#: when parsed), a hyperlink, and a bracketed word that markup would swallow.
MARKUP = ("[/bogus]", "[link=https://example.com/x]click[/link]", "[warmup] epoch 1")
#: Everything else a peer may send: C0 and C1 controls, the C1 form of ``ESC [``, bidi
#: overrides, a lone surrogate (a ``\\ud800`` escape in a JSON frame), tabs and newlines.
ODDITIES = ("\x00\x07\x08\x7f", "\x9b2J", "\u202eevil", "\ud800", "a\tb", "two\nlines", "\r")


def hostile(rng: random.Random) -> str:
    """A random mix of the above, with some plain text between."""
    parts = [rng.choice((*ATTACKS, *MARKUP, *ODDITIES, "plain", "日本 🙂")) for _ in range(3)]
    return "".join(parts)


def job_stream() -> list[Message]:
    """One job with a message of every kind the viewer and the report read."""
    cpu = DeviceInfo("cpu", "cpu")
    cuda = DeviceInfo("cuda:0", "NVIDIA H100", 80 * GiB, "GPU-1234", "9.0")
    frame = StackFrame("/w/train.py", 12, "train_step")
    site = AllocationSite("/w/train.py", 12, "train_step", GiB, 3, [frame])
    op = OpStat("aten::mm", 10, 0.5, 0.4, 0.3, 0.2, "[[8, 8], [8, 8]]", "train.py:12")
    loader = LoaderStats(
        0, "loader 0", "MyDataset", 32, 2, True, 2, False, "fork", 10, 320, 0.5, 1, 0.2,
        0.1, [WorkerStats(7, True, 10.0, GiB)], 10, "python", "list of 5,000 dict in .rows",
    )  # fmt: skip
    memory = MemoryStats("cuda:0", "cuda", GiB, 2 * GiB, GiB, 0, GiB, 2 * GiB, 0, 0)
    gpu = GpuStats(
        0, "NVIDIA H100", 50.0, 20.0, GiB, 80 * GiB, 60.0, 300.0, 700.0, 1500, 2600,
        [GpuProcess(42, GiB)], False, "GPU-1234", "cuda:0", True,
    )  # fmt: skip
    capture: dict[str, Any] = dict(
        device="cuda:0",
        emulated=False,
        requested_bytes=GiB,
        free_bytes=GiB // 2,
        total_bytes=80 * GiB,
        reserved_bytes=79 * GiB,
        allocated_bytes=78 * GiB,
        largest_free_block_bytes=GiB // 4,
        fragmented=False,
        top_sites=[site],
        snapshot_path="/tmp/42-oom-1.pickle",
        snapshot_error="",
        requested_stack=[frame],
    )
    steps = StepStats(
        T0 + 2.5, 4, 0, 4, 0, 3, 0.3, 0.03, 0.1, 0.01, 96,
        [T0 + 2.2, T0 + 2.3, T0 + 2.4, T0 + 2.5], [None, 0.1, 0.1, 0.1],
        [0.0, 0.01, 0.01, 0.01], [0.1, 0.0, 0.0, 0.0], [0.0, 0.003, 0.003, 0.004], [32] * 4,
    )  # fmt: skip
    ops = OpsWindow(
        T0 + 3, 1, T0 + 2.6, 0.4, 2, 0.01, 10.0, True, 1, 2, [op], 2, 0.4, 1, 2, [op],
        trace_path="/tmp/42-ops-1.json", matmuls=[MatmulDtype("float", 3)],
        total_matmuls=[MatmulDtype("float", 3)], activation_bytes=GiB,
        activations=[ModuleBytes("encoder.layers.3", GiB // 2)],
    )  # fmt: skip
    hello = Hello(
        1, 42, ["train.py", "--name", "x"], "/w", T0, "3.11.9", "2.4.0", [cpu, cuda], 0.1,
        "node-1", 0, 0, 2, 0, "run-1", 0, 30.0,
    )  # fmt: skip
    return [
        hello,
        ProbeStatus(T0 + 0.1, "nvml", False, "NVML is not installed"),
        ProbeStatus(T0 + 0.1, "ops", False, "torch.profiler is busy"),
        Sample(T0 + 0.5, HostStats(GiB, 50.0, 8, 2, 8 * GiB, 64 * GiB, 8, 2), [memory]),
        GpuSample(T0 + 0.5, [gpu]),
        PhaseBegan(T0 + 1, "warmup", 1, "the first epoch"),
        Marked(T0 + 1.5, "checkpoint"),
        LogLine(T0 + 1.6, "stdout", "epoch 1 loss 0.5"),
        LogLine(T0 + 1.7, "stderr", "a warning"),
        Sample(T0 + 2, HostStats(GiB, 50.0, 8, 2, 8 * GiB, 64 * GiB, 8, 2), [memory]),
        LoaderInfo(T0 + 2.1, [loader]),
        MemoryHolders(
            T0 + 2.2, 1, [DeviceHolding("cuda:0", GiB, GiB // 2, 2 * GiB, GiB // 4)], True
        ),
        CollectivesSeen(
            T0 + 2.3, [CollectiveEntry("0", 1, "gloo:all_reduce", [[4, 4]], int(T0 * 1e9))]
        ),
        steps,
        PhaseEnded(T0 + 2.6, "warmup", 1),
        ops,
        OutOfMemory(T0 + 4, 1, **capture, message="CUDA out of memory.", paused=False),
        MemorySnapshotTaken(T0 + 5, 2, **capture, request_id=1),
        OomResumed(T0 + 5.5, 1, "dismissed"),
        StackSampled(T0 + 40, 35.0, 30.0, 4, "MainThread", [frame]),
        Dropped(T0 + 40, 1),
        AgentStats(T0 + 40, 1, 0, 1, 10, 0, 0.001, 0.002),
        JobExited(T0 + 41, 1, "exited with code 1"),
        # Frames a viewer does not fold, sent between other peers.
        ClientHello(1, "viewer", "token"),
        Request("snapshot", 1),
        RelayHello(1, "0.1", "node-1", 43, "run-1"),
        Refused("bad token"),
    ]


assert {type(m).KIND for m in job_stream()} == set(MESSAGE_TYPES), "a kind is missing"


def with_text(messages: list[Message], text: Callable[[str], str]) -> list[Message]:
    """``messages`` with every string in them replaced by ``text(original)``, each original
    replaced the same way throughout."""
    chosen: dict[str, str] = {}

    def replace(value: Any) -> Any:
        if isinstance(value, str):
            if value not in chosen:
                chosen[value] = text(value)
            return chosen[value]
        if isinstance(value, list):
            return [replace(item) for item in value]
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.replace(
                value,
                **{f.name: replace(getattr(value, f.name)) for f in dataclasses.fields(value)},
            )
        return value

    return [replace(m) for m in messages]


def write_recording(path: Path, messages: list[Message]) -> Path:
    """``messages`` as a recording file, frame by frame (a lone surrogate as its JSON escape)."""
    with path.open("wb") as f:
        for message in messages:
            f.write(encode(message))
    return path
