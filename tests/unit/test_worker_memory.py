"""The smaps_rollup reader: its tolerant parser, on text read from a real kernel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from torchtop.protocol import LoaderInfo, LoaderStats, WorkerStats, decode, encode
from torchtop.streams.worker_memory import (
    parse_smaps_rollup,
    read_worker,
    read_workers,
    with_worker_memory,
)

#: /proc/self/smaps_rollup of `cat` on Linux 6.x, as read.
ROLLUP = """\
55b832401000-7ffebe6df000 ---p 00000000 00:00 0                          [rollup]
Rss:                1604 kB
Pss:                 254 kB
Pss_Dirty:           112 kB
Pss_Anon:            112 kB
Pss_File:            142 kB
Pss_Shmem:             0 kB
Shared_Clean:       1452 kB
Shared_Dirty:          0 kB
Private_Clean:        40 kB
Private_Dirty:       112 kB
Referenced:         1604 kB
Anonymous:           112 kB
Swap:                  0 kB
"""


def test_parse_splits_private_from_shared() -> None:
    mem = parse_smaps_rollup(ROLLUP, pid=7)
    assert mem is not None
    assert (mem.pid, mem.rss, mem.pss) == (7, 1604 * 1024, 254 * 1024)
    assert mem.uss == (40 + 112) * 1024
    assert mem.shared == 1452 * 1024


def test_parse_is_tolerant() -> None:
    assert parse_smaps_rollup("", pid=1) is None
    assert parse_smaps_rollup("garbage\nRss: lots kB\n", pid=1) is None
    mem = parse_smaps_rollup("Private_Dirty: 8 kB\nRss: 12\nNoise:\n", pid=1)
    assert mem is not None
    assert (mem.uss, mem.rss, mem.shared, mem.pss) == (8192, 12288, 0, 0)


def test_read_real_process_and_skip_missing(tmp_path: Path) -> None:
    me = read_worker(os.getpid())
    assert me is not None and me.uss > 0 and me.rss >= me.uss
    gone = tmp_path / "proc"  # an empty /proc: every pid has ended
    gone.mkdir()
    assert read_worker(os.getpid(), gone) is None
    loader = read_workers([os.getpid(), 2**31 - 1])
    assert [w.pid for w in loader.workers] == [os.getpid()]
    assert loader.uss > 0 and loader.pss > 0


def _info(*workers: WorkerStats) -> LoaderInfo:
    loader = LoaderStats(
        index=1,
        name="loader 1",
        dataset="RowsDataset",
        batch_size=8,
        num_workers=len(workers),
        pin_memory=False,
        prefetch_factor=2,
        persistent_workers=False,
        workers=list(workers),
    )
    return LoaderInfo(t=1.0, loaders=[loader])


def test_fills_only_the_jobs_own_live_workers() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        info = _info(
            WorkerStats(pid=child.pid, alive=True),
            WorkerStats(pid=os.getpid(), alive=True),  # not a child of the job: another host's pid
            WorkerStats(pid=child.pid, alive=False),
        )
        filled = with_worker_memory(info, job_pid=os.getpid())
        mine, other, dead = filled.loaders[0].workers
        assert mine.uss_bytes is not None and mine.uss_bytes > 0
        assert mine.pss_bytes is not None and mine.shared_bytes is not None
        assert other.uss_bytes is None and dead.uss_bytes is None
        assert decode(encode(filled)) == filled  # travels and records as it is
        assert with_worker_memory(info, job_pid=1) is info  # none read: unchanged
    finally:
        child.communicate(b"")
