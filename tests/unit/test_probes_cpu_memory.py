from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest

from torchtop.agent.probes.cpu_memory import (
    SOURCE_HEAP,
    SOURCE_RSS,
    CpuMemoryProbe,
    find_mallinfo2,
)

MIB = 1 << 20


class FakeMallinfo:
    """Returns the heap figures a test sets, as mallinfo2 would."""

    def __init__(self, uordblks: int, hblkhd: int) -> None:
        self.uordblks = uordblks
        self.hblkhd = hblkhd
        self.calls = 0

    def __call__(self) -> SimpleNamespace:
        self.calls += 1
        return SimpleNamespace(uordblks=self.uordblks, hblkhd=self.hblkhd, arena=0, keepcost=0)


def test_heap_in_use_is_arena_chunks_plus_mapped_chunks() -> None:
    mallinfo = FakeMallinfo(uordblks=30 * MIB, hblkhd=200 * MIB)
    probe = CpuMemoryProbe(mallinfo)
    stats = probe.read(rss_bytes=400 * MIB)
    assert stats.device == "cpu"
    assert stats.source == SOURCE_HEAP
    assert stats.allocated_bytes == 230 * MIB
    assert stats.reserved_bytes == 400 * MIB
    assert stats.peak_allocated_bytes == 230 * MIB
    assert stats.peak_reserved_bytes == 400 * MIB
    # The CUDA-only fields have no CPU counterpart.
    assert stats.active_bytes is None and stats.num_ooms is None and stats.total_bytes is None


def test_the_heap_every_nth_read_and_the_rss_every_read() -> None:
    mallinfo = FakeMallinfo(uordblks=30 * MIB, hblkhd=0)
    probe = CpuMemoryProbe(mallinfo, heap_every=5)
    seen = []
    for i in range(11):
        mallinfo.uordblks = (30 + i) * MIB
        stats = probe.read(rss_bytes=(400 + i) * MIB)
        seen.append((stats.allocated_bytes, stats.reserved_bytes))
    assert mallinfo.calls == 3  # reads 0, 5 and 10
    assert [a for a, _ in seen] == [30 * MIB] * 5 + [35 * MIB] * 5 + [40 * MIB]
    assert [r for _, r in seen] == [(400 + i) * MIB for i in range(11)]
    with pytest.raises(ValueError):
        CpuMemoryProbe(mallinfo, heap_every=0)


def test_without_mallinfo2_allocated_is_the_rss() -> None:
    probe = CpuMemoryProbe(mallinfo=None)
    stats = probe.read(rss_bytes=400 * MIB)
    assert stats.source == SOURCE_RSS
    assert stats.allocated_bytes == 400 * MIB
    assert stats.reserved_bytes == 400 * MIB
    unknown = probe.read(rss_bytes=None)
    assert unknown.allocated_bytes is None and unknown.reserved_bytes is None
    assert unknown.peak_allocated_bytes == 400 * MIB


def test_peaks_are_running_maxima_until_reset() -> None:
    mallinfo = FakeMallinfo(uordblks=0, hblkhd=100 * MIB)
    probe = CpuMemoryProbe(mallinfo)
    probe.read(rss_bytes=300 * MIB)
    mallinfo.hblkhd = 500 * MIB
    probe.read(rss_bytes=700 * MIB)
    mallinfo.hblkhd = 50 * MIB
    stats = probe.read(rss_bytes=350 * MIB)
    assert (stats.allocated_bytes, stats.reserved_bytes) == (50 * MIB, 350 * MIB)
    assert (stats.peak_allocated_bytes, stats.peak_reserved_bytes) == (500 * MIB, 700 * MIB)

    probe.reset_peaks()
    mallinfo.hblkhd = 60 * MIB
    stats = probe.read(rss_bytes=340 * MIB)
    assert (stats.peak_allocated_bytes, stats.peak_reserved_bytes) == (60 * MIB, 350 * MIB)


def test_a_failing_heap_reader_gives_none_not_an_exception() -> None:
    def broken() -> SimpleNamespace:
        raise OSError("no heap")

    stats = CpuMemoryProbe(broken).read(rss_bytes=100 * MIB)
    assert stats.source == SOURCE_HEAP
    assert stats.allocated_bytes is None
    assert stats.reserved_bytes == 100 * MIB


def test_glibc_lookup_matches_the_platform() -> None:
    probe = CpuMemoryProbe()
    assert probe.source == (SOURCE_HEAP if find_mallinfo2() is not None else SOURCE_RSS)


@pytest.mark.skipif(find_mallinfo2() is None, reason="needs glibc's mallinfo2")
def test_a_100_mb_tensor_moves_the_heap_reading_by_100_mb() -> None:
    torch = pytest.importorskip("torch")
    probe = CpuMemoryProbe()
    size = 100 * MIB
    gc.collect()
    before = probe.read(rss_bytes=None).allocated_bytes
    tensor = torch.ones(size, dtype=torch.uint8)
    during = probe.read(rss_bytes=None).allocated_bytes
    del tensor
    gc.collect()
    after = probe.read(rss_bytes=None).allocated_bytes
    assert before is not None and during is not None and after is not None
    assert abs((during - before) - size) < 4 * MIB, (before, during, after)
    assert abs((during - after) - size) < 4 * MIB, (before, during, after)
