"""What one read of torch's flight recorder costs the agent, by ring size, on a real gloo job.

Two ranks (gloo, CPU, started by ``torch.multiprocessing.spawn``) each fill their ring of
``--ring`` entries with all-reduces, then rank 0 times, in its own thread, each way of reading
it (the median of ``--reads`` reads, in CPU time of the reading thread, as the agent's cost
budget counts it, and wall time; every dump holds the GIL, so a step that holds the GIL waits
as long):

- ``json whole``: the JSON dump and a parse of every entry (the reader before it read only
  what changed);
- ``pickle whole``: the pickle dump without stack traces, loaded, every entry parsed;
- ``pickle new``: the same dump and load, the scan stopping at the last entry already sent
  (here 10 new entries): what :class:`torchtop.agent.collectives.CollectiveReader` does;
- ``status``: the dump without entries that says whether the ring changed (every tick of an
  idle or hung job costs only this);
- ``tick idle`` and ``tick new``: :meth:`CollectiveReader.poll` itself, with nothing new
  (the status alone) and with 10 new entries.

    python -m benchmarks.fr_read_cost                     # rings of 512 and 2000
    python -m benchmarks.fr_read_cost --ring 256 --reads 50
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: New entries between two reads in the ``new`` rows.
NEW = 10


def timed(fn: Callable[[], Any], reads: int) -> tuple[float, float]:
    """The median CPU time and wall time of ``fn``, in milliseconds."""
    cpu, wall = [], []
    for _ in range(reads):
        c0, t0 = time.thread_time(), time.perf_counter()
        fn()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(cpu), 1e3 * statistics.median(wall)


def worker(rank: int, port: int, ring: int, reads: int, out: str) -> None:
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(ring)
    import torch
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d

    from torchtop.agent import collectives as fr

    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    torch.set_num_threads(1)
    grad = torch.ones(4096)
    for _ in range(ring + NEW):
        dist.all_reduce(grad)
    time.sleep(0.5)  # gloo retires the last works
    dist.barrier()
    if rank == 0:
        (recorder,) = fr._recorders()
        status = recorder.status
        as_json = c10d._dump_fr_trace_json  # type: ignore[attr-defined]
        assert status is not None
        newest = fr.parse_dump(recorder.read())[-1].record_id
        rows = {
            "json whole": timed(lambda: fr.parse_dump(bytes(as_json(True, False))), reads),
            "pickle whole": timed(lambda: fr.parse_dump(recorder.read()), reads),
            "pickle new": timed(lambda: fr.parse_dump(recorder.read(), after=newest - NEW), reads),
            "status": timed(lambda: fr._group_status(status()), reads),
        }
        # The reader's own poll: nothing new (status alone), then NEW new entries each time.
        clock = [0.0]
        reader = fr.CollectiveReader(
            recorder.read, clock=lambda: clock[0], status=recorder.status, share=0.0
        )
        reader.poll()

        def poll() -> None:
            clock[0] += 10.0
            reader.poll()

        rows["tick idle"] = timed(poll, reads)
        cpu, wall, sent = [], [], []
        for _ in range(reads):
            for _ in range(NEW):
                dist.all_reduce(grad)  # rank 1 meets them in its loop below
            clock[0] += 10.0
            c0, t0 = time.thread_time(), time.perf_counter()
            sent.append(len(reader.poll()))
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - t0)
        rows["tick new"] = (1e3 * statistics.median(cpu), 1e3 * statistics.median(wall))
        rows["sent per new tick"] = (statistics.median(sent), statistics.median(sent))
        Path(out).write_text(json.dumps(rows))
    else:
        for _ in range(reads * NEW):
            dist.all_reduce(grad)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ring", type=int, action="append", help="ring sizes (512 and 2000)")
    parser.add_argument("--reads", type=int, default=30)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    print(f"load: {os.getloadavg()[0]:.2f} (1 min)", flush=True)
    for ring in args.ring or [512, 2000]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        with tempfile.TemporaryDirectory() as folder:
            out = str(Path(folder, "rows.json"))
            mp.spawn(worker, args=(port, ring, args.reads, out), nprocs=2)
            rows = json.loads(Path(out).read_text())
        print(
            f"ring of {ring} entries, 2 gloo ranks, median of {args.reads} reads (ms, CPU / wall):"
        )
        for name, (cpu, wall) in rows.items():
            print(f"  {name:22} {cpu:9.3f} {wall:9.3f}")
    print(f"load: {os.getloadavg()[0]:.2f} (1 min)")


if __name__ == "__main__":
    main()
