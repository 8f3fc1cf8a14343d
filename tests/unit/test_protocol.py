from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from torchtop import protocol
from torchtop.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    DeviceInfo,
    FrameSplitter,
    GpuProcess,
    GpuSample,
    GpuStats,
    Hello,
    HostStats,
    JobExited,
    LogLine,
    MemoryStats,
    Message,
    ProtocolError,
    Sample,
    decode,
    encode,
)


def _hello() -> Hello:
    return Hello(
        protocol=PROTOCOL_VERSION,
        pid=42,
        argv=["train.py", "--lr", "3e-4"],
        cwd="/work",
        started_at=1.5,
        python="3.11.7",
        torch="2.13.0",
        devices=[DeviceInfo(id="cpu", name="x86_64"), DeviceInfo("cuda:0", "H200", 150 << 30)],
        interval_s=0.1,
    )


def _sample() -> Sample:
    return Sample(
        t=12.25,
        host=HostStats(1 << 30, 97.5, 12, 2, 8 << 30, 24 << 30),
        memory=[
            MemoryStats("cpu", "cpu-heap", 100, 200),
            MemoryStats("cuda:0", "cuda-allocator", 3, 4, 3, 1, 5, 6, 0, 1, 10, 20),
        ],
    )


@pytest.mark.parametrize(
    "message",
    [
        _hello(),
        _sample(),
        GpuSample(t=1.0, gpus=[GpuStats(0, "H200", 50.0, processes=[GpuProcess(7, None)])]),
        GpuSample(t=1.0, gpus=[GpuStats(1, None, lost=True)]),
        LogLine(t=2.0, stream="stderr", text="naïve ✓ \t tab"),
        JobExited(t=3.0, exit_code=-9, reason="killed by SIGKILL"),
    ],
)
def test_round_trip(message: object) -> None:
    frame = encode(message)  # type: ignore[arg-type]
    assert frame.endswith(b"\n") and frame.count(b"\n") == 1
    assert decode(frame[:-1]) == message


def test_bytes_stay_int_and_seconds_float() -> None:
    decoded = decode(b'{"kind":"exit","t":3,"exit_code":0}')
    assert isinstance(decoded, JobExited)
    assert isinstance(decoded.t, float) and decoded.t == 3.0
    with pytest.raises(ProtocolError, match="integer"):
        decode(b'{"kind":"exit","t":3,"exit_code":1.5}')
    with pytest.raises(ProtocolError, match="integer"):
        decode(b'{"kind":"exit","t":3,"exit_code":true}')


def test_unknown_kind_is_skipped_and_unknown_fields_ignored() -> None:
    assert decode(b'{"kind":"from_the_future","x":1}') is None
    decoded = decode(b'{"kind":"mark","t":1,"name":"a","added_later":[1,2]}')
    assert decoded is not None and decoded.KIND == "mark"


@pytest.mark.parametrize(
    "frame, reason",
    [
        (b"\x00\xff\xfe garbage", "JSON"),
        (b"[1,2,3]", "object"),
        (b'{"t":1}', "kind"),
        (b'{"kind":"mark","t":1}', "missing field 'name'"),
        (b'{"kind":"sample","t":1,"host":null,"memory":{"a":1}}', "list"),
        (b'{"kind":"sample","t":1,"host":null,"memory":[{"device":"cpu"}]}', "missing"),
        (b'{"kind":"hello","protocol":"1"}', "integer"),
        (b'{"kind":"log","t":1,"stream":"stdout","text":"x"', "JSON"),
        (b'{"kind":"mark","t":NaN,"name":"a"}', ""),
    ],
)
def test_malformed_frames_raise(frame: bytes, reason: str) -> None:
    try:
        result = decode(frame)
    except ProtocolError as exc:
        assert reason in str(exc)
    else:
        # NaN is valid for Python's json but never produced by encode(); it must not crash.
        assert reason == "" and result is not None


def test_nothing_is_evaluated() -> None:
    payload = json.dumps({"kind": "mark", "t": 1, "name": "__import__('os').system('false')"})
    decoded = decode(payload.encode())
    assert decoded is not None and decoded.name.startswith("__import__")


def test_oversized_frame_rejected_on_both_sides() -> None:
    big = LogLine(t=0.0, stream="stdout", text="x" * MAX_FRAME_BYTES)
    with pytest.raises(ProtocolError, match="exceeds"):
        encode(big)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(b"{" + b" " * MAX_FRAME_BYTES + b"}")


def test_splitter_reassembles_and_limits() -> None:
    splitter = FrameSplitter(limit=32)
    assert list(splitter.feed(b'{"a":1}\n{"b"')) == [b'{"a":1}']
    assert splitter.pending == 4
    assert list(splitter.feed(b":2}\n\n")) == [b'{"b":2}', b""]
    with pytest.raises(ProtocolError):
        list(splitter.feed(b"y" * 40))
    with pytest.raises(ProtocolError):
        list(FrameSplitter(limit=8).feed(b"123456789\n"))


def test_a_valid_frame_takes_the_fast_checks_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # The field-by-field check that names a fault is for malformed frames only: a reader of
    # tens of frames a second spent ten times the JSON parse naming each value's place.
    def naming(*args: object) -> None:
        raise AssertionError("a valid frame went through the error path")

    monkeypatch.setattr(protocol, "_build", naming)
    for message in (_hello(), _sample(), JobExited(t=3.0, exit_code=None, reason="")):
        assert decode(encode(message)[:-1]) == message


ODD_VALUES = (None, True, 0, 7, 1.5, "x", [], [1], {}, {"device": "cpu"})


def _variants(obj: Any) -> Iterator[Any]:
    """``obj`` with one value at a time replaced by each of ODD_VALUES, at every depth."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            for other in (*ODD_VALUES, *_variants(value)):
                yield {**obj, key: other}
            yield {k: v for k, v in obj.items() if k != key}
    elif isinstance(obj, list):
        for index, value in enumerate(obj):
            for other in (*ODD_VALUES, *_variants(value)):
                yield [*obj[:index], other, *obj[index + 1 :]]


@pytest.mark.parametrize("message", [_hello(), _sample(), GpuSample(1.0, [GpuStats(0, "H200")])])
def test_the_fast_checks_accept_and_refuse_what_the_named_checks_do(message: Message) -> None:
    cls = type(message)
    body = json.loads(encode(message))
    del body["kind"]
    for variant in _variants(body):
        try:
            expected = protocol._build(cls, variant, message.KIND)
        except ProtocolError:
            with pytest.raises(protocol._Invalid):
                protocol._decoder(cls)(variant)
        else:
            assert protocol._decoder(cls)(variant) == expected, variant
