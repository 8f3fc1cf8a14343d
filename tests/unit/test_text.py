"""Text torchtop did not write: control characters shown as escapes, wherever it lands."""

from __future__ import annotations

import unicodedata

import pytest

from torchtop.model.connection import SourceDisconnected, SourceStatus
from torchtop.model.job import JobModel
from torchtop.protocol import (
    DeviceInfo,
    Hello,
    HostStats,
    JobExited,
    LogLine,
    Marked,
    MemoryStats,
    PhaseBegan,
    ProbeStatus,
    Sample,
)
from torchtop.text import printable, printable_message

T0 = 1_700_000_000.0
TITLE = "\x1b]0;PWNED\x07"
CLIPBOARD = "\x1b]52;c;cm0gLXJmIH4=\x07"
CLEAR = "\x1b[2J"


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("epoch 1", "epoch 1"),
        ("", ""),
        (TITLE, "\\x1b]0;PWNED\\x07"),
        (CLEAR, "\\x1b[2J"),
        ("a\x00b\x7fc", "a\\x00b\\x7fc"),
        ("csi \x9b2J", "csi \\x9b2J"),  # the C1 form of ESC [
        ("bell\x07 back\x08", "bell\\x07 back\\x08"),
        ("cr\rlf\nnel\x85", "cr\\rlf\nnel\\x85"),
        ("tab\there", "tab\there"),
        ("rtl \u202eevil\u202c", "rtl \\u202eevil\\u202c"),
        ("lone \ud800 surrogate", "lone \\ud800 surrogate"),
        ("naïve 日本語 🙂 [warmup]", "naïve 日本語 🙂 [warmup]"),
    ],
)
def test_printable_escapes_what_a_terminal_would_act_on(raw: str, shown: str) -> None:
    assert printable(raw) == shown


def test_printable_one_line_shows_tabs_and_newlines() -> None:
    assert printable("a\tb\nc\x1b", one_line=True) == "a\\tb\\nc\\x1b"
    assert printable("a b", one_line=True) == "a b"


def test_printable_output_is_safe_to_write() -> None:
    everything = "".join(chr(c) for c in range(0x3000)) + "\udfff"
    shown = printable(everything)
    assert not any(0xD800 <= ord(c) < 0xE000 for c in shown)
    controls = {c for c in shown if unicodedata.category(c) == "Cc"}
    assert controls == {"\t", "\n"}
    assert not any(c in shown for c in "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
    assert "\x1b" not in shown and "\x9b" not in shown
    shown.encode("utf-8")  # no lone surrogate left to fail on
    assert printable(shown) == shown  # escaping twice changes nothing more


def test_printable_message_leaves_plain_messages_alone() -> None:
    sample = Sample(T0, HostStats(1, 2.0, 3, 0, 4, 5), [MemoryStats("cpu", "cpu-rss", 1, 2)])
    assert printable_message(sample) is sample


def test_printable_message_reaches_every_nested_string() -> None:
    hello = Hello(
        protocol=1,
        pid=1,
        argv=["train.py", f"--name={TITLE}"],
        cwd=CLEAR,
        started_at=T0,
        python="3.11",
        torch=None,
        devices=[DeviceInfo("cpu", f"cpu{CLIPBOARD}")],
        interval_s=0.1,
        run_id=TITLE,
    )
    shown = printable_message(hello)
    assert shown.argv == ["train.py", "--name=\\x1b]0;PWNED\\x07"]
    assert shown.cwd == "\\x1b[2J"
    assert shown.devices[0].name == "cpu\\x1b]52;c;cm0gLXJmIH4=\\x07"
    assert shown.run_id == "\\x1b]0;PWNED\\x07"
    assert (shown.pid, shown.started_at, shown.interval_s) == (1, T0, 0.1)
    assert "\x1b" not in repr(shown)


def _hello(**fields: object) -> Hello:
    base: dict[str, object] = dict(
        protocol=1,
        pid=42,
        argv=["train.py"],
        cwd="/w",
        started_at=T0,
        python="3.11",
        torch=None,
        devices=[DeviceInfo("cpu", "cpu")],
        interval_s=0.1,
    )
    base.update(fields)
    return Hello(**base)  # type: ignore[arg-type]


def test_the_model_keeps_no_control_character_of_a_message() -> None:
    """Whatever reads the model (viewer, report, exporters) finds text it can show."""
    model = JobModel()
    model.apply(_hello(argv=["train.py", TITLE], devices=[DeviceInfo("cpu", CLEAR)]))
    model.apply(Sample(T0 + 1, None, [MemoryStats(f"cpu{CLEAR}", "cpu-rss", 1, 2)]))
    model.apply(ProbeStatus(T0 + 1, "nvml", False, f"no GPU {CLIPBOARD}"))
    model.apply(PhaseBegan(T0 + 1, f"warm {TITLE}", 1, description=CLEAR))
    model.apply(Marked(T0 + 1, f"mark {CLEAR}"))
    model.apply(LogLine(T0 + 2, "stdout", f"loss 0.5 {TITLE}\ttabbed"))
    model.apply(JobExited(T0 + 3, 1, f"killed {CLIPBOARD}"))
    model.apply(SourceDisconnected(T0 + 3, f"gone {CLEAR}"))
    model.apply(SourceStatus(T0 + 3, f"status {TITLE}"))
    assert model.hello is not None
    assert model.hello.argv == ["train.py", "\\x1b]0;PWNED\\x07"]
    assert [d.name for d in model.devices] == ["\\x1b[2J"]
    assert list(model.memory) == ["cpu\\x1b[2J"]
    assert model.probes["nvml"].detail == "no GPU \\x1b]52;c;cm0gLXJmIH4=\\x07"
    assert model.phases[0].name == "warm \\x1b]0;PWNED\\x07"
    assert model.phases[0].description == "\\x1b[2J"
    assert model.marks[0].name == "mark \\x1b[2J"
    assert model.logs[0].text == "loss 0.5 \\x1b]0;PWNED\\x07\ttabbed"
    assert model.exit_reason == "killed \\x1b]52;c;cm0gLXJmIH4=\\x07"
    assert model.status_text == "status \\x1b]0;PWNED\\x07"
    assert "\x1b" not in repr(vars(model))


def test_the_model_applies_a_progress_bar_redraw_before_escaping() -> None:
    model = JobModel()
    model.apply(LogLine(T0, "stderr", "10%\r50%\r100%\r\n"))
    assert model.logs[0].text == "100%"
