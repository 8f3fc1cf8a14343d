"""The loaders panel shows the workers' private memory (USS) where it was read."""

from __future__ import annotations

from torchtop.protocol import LoaderStats, WorkerStats
from torchtop.tui.widgets.loaders import loader_lines


def _loader(*workers: WorkerStats) -> LoaderStats:
    return LoaderStats(
        index=0,
        name="loader 0",
        dataset="Rows",
        batch_size=None,
        num_workers=2,
        pin_memory=False,
        prefetch_factor=2,
        persistent_workers=False,
        start_method="fork",
        workers=list(workers),
    )


def test_workers_line_sums_private_memory_of_live_workers() -> None:
    mib = 1 << 20
    line = loader_lines(
        _loader(
            WorkerStats(11, True, rss_bytes=400 * mib, uss_bytes=100 * mib),
            WorkerStats(12, True, rss_bytes=400 * mib, uss_bytes=60 * mib),
            WorkerStats(13, False, uss_bytes=999 * mib),
        )
    )[-1].plain
    assert "RSS 800 MiB" in line and "private 160 MiB (80.0 MiB each)" in line
    unread = loader_lines(_loader(WorkerStats(11, True, rss_bytes=400 * mib)))[-1].plain
    assert "private" not in unread  # another host's job: not read, not shown
