"""The jobs the GPU check runs (needs CUDA): each writes what the job itself read to a JSON file.

``python benchmarks/gpu_check_jobs.py JOB OUT.json [ARGS]``, usually under ``torchtop run
--headless --record``. What a job writes is the independent source of truth that
:mod:`benchmarks.gpu_check_compare` holds the agent's frames against: ``torch.cuda.memory_stats()``
read in the job, the allocator's out-of-memory observer's own arguments, the snapshot at the
failure, the job's own ``torch.profiler`` tables, timings. Lines that the checks look up by
their marker comment (``# gpu_check: ...``) must keep it.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20
GIB = 1 << 30


def _write(path: str, payload: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(payload, default=str))
    os.chmod(path, 0o600)


def _stats() -> dict[str, Any]:
    import torch

    return dict(torch.cuda.memory_stats(0))


def _uuid(props: Any) -> str:
    return str(getattr(props, "uuid", ""))


def _bounded_snapshot(snapshot: dict[str, Any], entries: int = 300) -> dict[str, Any]:
    """The snapshot with the last ``entries`` history entries and 8 frames a stack: a fixture
    small enough to commit."""

    def frames(item: dict[str, Any]) -> dict[str, Any]:
        if "frames" in item:
            item = {**item, "frames": item["frames"][:8]}
        return item

    segments = []
    for segment in snapshot.get("segments", []):
        blocks = [frames(b) for b in segment.get("blocks", [])]
        segments.append({**segment, "blocks": blocks})
    traces = [[frames(e) for e in trace[-entries:]] for trace in snapshot.get("device_traces", [])]
    return {"segments": segments, "device_traces": traces}


def free_blocks(snapshot: dict[str, Any], device: int, stream: int | None = None) -> list[int]:
    """The sizes of the free (``inactive``) blocks in a snapshot's segments on ``device``, on
    ``stream`` only if given: the allocator serves a request from its own stream's blocks."""
    return [
        int(b["size"])
        for s in snapshot.get("segments", [])
        if s.get("device", device) == device and (stream is None or s.get("stream") == stream)
        for b in s.get("blocks", [])
        if b.get("state") == "inactive"
    ]


class Observer:
    """The job's own out-of-memory observer, attached beside the agent's as users attach one
    (PyTorch's docs suggest it, to dump a snapshot): the allocator calls every observer, in the
    order attached, then throws. It records the allocator's arguments, its counters and the
    snapshot's figures at the moment of the failure, and the thread it was called in."""

    def __init__(self, keep_snapshot: bool) -> None:
        self.calls: list[dict[str, Any]] = []
        self.keep_snapshot = keep_snapshot
        self.snapshot: dict[str, Any] | None = None
        self.attach_error = ""
        #: What could not be read in a call (the snapshot, on the cudaMallocAsync backend).
        self.errors: list[str] = []

    def __call__(self, device: int, alloc: int, device_total: int, device_free: int) -> None:
        # Never raise: an exception here would replace the job's OutOfMemoryError.
        try:
            self._record(int(device), int(alloc), int(device_total), int(device_free))
        except Exception as exc:
            self.errors.append(repr(exc))

    def _record(self, device: int, alloc: int, device_total: int, device_free: int) -> None:
        import torch

        call: dict[str, Any] = {
            "t": time.time(),
            "device": device,
            "alloc": alloc,
            "device_total": device_total,
            "device_free": device_free,
            "memory_stats": dict(torch.cuda.memory_stats(device)),
            "main_thread": threading.current_thread() is threading.main_thread(),
        }
        self.calls.append(call)
        snapshot = torch.cuda.memory._snapshot()  # not on the cudaMallocAsync backend
        ooms = [e for e in snapshot["device_traces"][device] if e.get("action") == "oom"]
        stream = ooms[-1].get("stream") if ooms else None
        call["trace_oom_size"] = int(ooms[-1]["size"]) if ooms else None
        call["trace_oom_device_free"] = int(ooms[-1].get("device_free", -1)) if ooms else None
        call["oom_stream"] = stream
        blocks = free_blocks(snapshot, device)
        call["largest_free_block"] = max(blocks, default=0)
        call["free_in_segments"] = sum(blocks)
        if stream is not None:
            call["largest_free_block_on_stream"] = max(
                free_blocks(snapshot, device, stream), default=0
            )
        if self.keep_snapshot and self.snapshot is None:
            self.snapshot = _bounded_snapshot(snapshot)

    def attach(self) -> None:
        import torch

        try:
            torch._C._cuda_attach_out_of_memory_observer(self)  # type: ignore[attr-defined]
        except Exception as exc:  # the cudaMallocAsync backend may not take one
            self.attach_error = repr(exc)


def _cap(fraction_bytes: int) -> float:
    """Cap the process at ``fraction_bytes`` of device memory; the fraction torch was given."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    fraction = fraction_bytes / total
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    return fraction


# --------------------------------------------------------------------------------------------
# allocator and NVML: plateaus where the job's memory and load hold still
# --------------------------------------------------------------------------------------------


def _energy_counter(uuid: str) -> Any:
    """The job's own read of NVML's total energy counter of its GPU (mJ since driver load), by
    torch's UUID; a read gives ``None`` without nvidia-ml-py or the counter."""
    try:
        import pynvml

        pynvml.nvmlInit()
        name = uuid if uuid.upper().startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
        handle = pynvml.nvmlDeviceGetHandleByUUID(name)
    except Exception:
        return lambda: None

    def read() -> int | None:
        try:
            return int(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))
        except Exception:
            return None

    return read


def job_allocator(out: str) -> None:
    """Training steps with plateaus between them: memory still and GPU idle, and memory still
    and GPU busy (matmuls into a preallocated output). Each plateau's ``memory_stats()`` is read
    at its start and end, with its wall-clock times."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    device = torch.device("cuda", 0)
    model = nn.Sequential(nn.Linear(2048, 4096), nn.GELU(), nn.Linear(4096, 2048)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(512, 2048, device=device)
    plateaus: list[dict[str, Any]] = []
    energy = _energy_counter(_uuid(torch.cuda.get_device_properties(0)))

    def train(steps: int) -> None:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
        torch.cuda.synchronize()

    def plateau(kind: str, seconds: float, work: Any = None) -> None:
        torch.cuda.synchronize()
        before = _stats()
        free, total = torch.cuda.mem_get_info(0)
        energy_before = energy()  # gpu_check: the job's own energy counter read
        t0 = time.time()
        end = t0 + seconds
        while time.time() < end:
            if work is None:
                time.sleep(0.01)
            else:
                work()
        torch.cuda.synchronize()
        t1 = time.time()
        energy_after = energy()
        plateaus.append(
            {
                "kind": kind,
                "t0": t0,
                "t1": t1,
                "before": before,
                "after": _stats(),
                "mem_get_info": [int(free), int(total)],
                "energy_mj": [energy_before, energy_after],
            }
        )

    train(20)
    plateau("idle", 1.5)
    a = torch.randn(8192, 8192, device=device)
    b = torch.randn(8192, 8192, device=device)
    c = torch.empty(8192, 8192, device=device)
    torch.matmul(a, b, out=c)  # cuBLAS's workspace is allocated here, before the plateau

    def matmuls() -> None:
        for _ in range(8):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize()

    plateau("busy", 4.0, matmuls)
    plateau("idle", 4.0)
    train(20)
    plateau("idle", 1.5)
    props = torch.cuda.get_device_properties(0)
    _write(
        out,
        {
            "plateaus": plateaus,
            "uuid": _uuid(props),
            "name": props.name,
            "total_memory": int(props.total_memory),
            "current_device": torch.cuda.current_device(),
            "final_stats": _stats(),
        },
    )


#: Long enough for every kind of op window to come due (time windows 5 s after the start).
CPU_JOB_S = 6.5


def _libcuda_mapped() -> bool:
    """Whether the CUDA driver library is mapped into this process: CUDA was initialized."""
    try:
        return "libcuda.so" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def job_cpu(out: str, seconds: float = CPU_JOB_S) -> None:
    """A CPU job on a GPU machine: imports torch and trains on the CPU for ``seconds``, never
    touching CUDA, with steps for op windows over steps and time enough for windows by time.
    It writes whether the CUDA driver ended up in the process."""
    import torch
    from torch import nn

    started = time.time()
    model = nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256)
    end = started + seconds
    steps = 0
    while time.time() < end:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        steps += 1
    _write(
        out,
        {
            "steps": steps,
            "seconds": time.time() - started,
            "cuda_initialized": torch.cuda.is_initialized(),
            "libcuda_mapped": _libcuda_mapped(),
        },
    )


def job_visible(out: str) -> None:
    """A short CUDA job (run with ``CUDA_VISIBLE_DEVICES`` set to a GPU's UUID): allocates,
    computes, holds still long enough for NVML reads, and writes the UUID torch gives its
    device."""
    import torch

    device = torch.device("cuda", 0)
    a = torch.randn(2048, 2048, device=device)
    for _ in range(10):
        a = a @ a
        a /= a.norm()
    torch.cuda.synchronize()
    time.sleep(2.5)
    props = torch.cuda.get_device_properties(0)
    _write(
        out,
        {
            "uuid": _uuid(props),
            "device_count": torch.cuda.device_count(),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        },
    )


# --------------------------------------------------------------------------------------------
# out of memory
# --------------------------------------------------------------------------------------------

FULL_CAP = 2 * GIB
FULL_WIDTH = 1024


def job_oom_full(out: str, catch: bool) -> None:
    """A batch that doubles under a 2 GiB cap until it no longer fits. Each new batch is made
    while the previous one is alive, so at the failure the previous batch is the top site.
    ``catch``: the job catches the error and writes what it read; else the error ends it."""
    import torch
    from torch import nn

    observer = Observer(keep_snapshot=True)
    torch.cuda.init()
    observer.attach()
    fraction = _cap(FULL_CAP)
    device = torch.device("cuda", 0)
    model = nn.Linear(FULL_WIDTH, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = 1024
    x = None
    requested = 0
    payload: dict[str, Any] = {"fraction": fraction, "cap": FULL_CAP}
    try:
        while True:
            requested = batch * FULL_WIDTH * 4
            x = torch.randn(batch, FULL_WIDTH, device=device)  # gpu_check: full top site
            opt.zero_grad(set_to_none=True)
            model(x).mean().backward()
            opt.step()
            torch.cuda.synchronize()
            batch *= 2
    except torch.OutOfMemoryError as exc:
        if not catch:
            raise
        payload["message"] = str(exc)
        payload["caught_at"] = time.time()
    payload.update(requested=requested, observer=observer.calls, snapshot=observer.snapshot)
    _write(out, payload)


FRAG_CAP = 1 * GIB
FRAG_BLOCK = 4 * MIB
FRAG_SEGMENTS = 50
#: A request above 10 MiB is rounded up to 2 MiB: 64.5 MiB asks the allocator for a 66 MiB
#: segment, so the request and the segment size differ.
FRAG_REQUEST = 64 * MIB + 512 * 1024


def job_oom_fragmented(out: str) -> None:
    """Fragmented on purpose, under a 1 GiB cap: 4 MiB blocks fill 50 segments of 20 MiB (five
    each), every other block is freed, and a 64.5 MiB request fails although 600 MiB is free in
    the segments (in 4 MiB pieces) and 24 MiB under the cap."""
    import torch

    observer = Observer(keep_snapshot=True)
    torch.cuda.init()
    observer.attach()
    fraction = _cap(FRAG_CAP)
    device = torch.device("cuda", 0)
    count = FRAG_SEGMENTS * 5
    blocks = [
        torch.empty(FRAG_BLOCK // 4, device=device)  # gpu_check: fragmented top site
        for _ in range(count)
    ]
    for i in range(0, count, 5):
        for j in (0, 2, 4):
            blocks[i + j] = None  # type: ignore[call-overload]
    payload: dict[str, Any] = {"fraction": fraction, "cap": FRAG_CAP, "requested": FRAG_REQUEST}
    payload["before"] = _stats()
    try:
        torch.empty(FRAG_REQUEST // 4, device=device)
        payload["message"] = ""
    except torch.OutOfMemoryError as exc:
        payload["message"] = str(exc)
    payload["caught_at"] = time.time()
    payload.update(observer=observer.calls, snapshot=observer.snapshot)
    _write(out, payload)


#: Convolutions whose first plan (cuDNN's heuristics, no benchmarking) likely needs a
#: workspace: (in channels, out channels, kernel, batch, height and width, half precision,
#: channels last).
HANDLED_CONVS = (
    (64, 64, 5, 16, 192, False, False),
    (64, 64, 7, 8, 192, False, False),
    (128, 128, 3, 32, 128, False, False),
    (256, 256, 3, 16, 96, False, False),
    (64, 64, 5, 16, 192, True, True),
    (128, 128, 3, 32, 128, True, True),
    (32, 64, 11, 8, 224, False, False),
    (256, 512, 1, 32, 64, True, False),
)


def job_oom_handled(out: str) -> None:
    """OOMs torch handles itself: with ``cudnn.benchmark`` off, cuDNN runs the plans its
    heuristics rank, each with its workspace, and moves to the next when the workspace cannot
    be allocated (``try_plans`` catches the OOM). Each convolution runs under a cap that leaves
    room for its output and nothing more, so a plan that needs any workspace fails. Each trial
    records the allocator's count of OOMs (``num_ooms``), the job's own observer's calls, and
    whether an OutOfMemoryError reached this code (another error, when no plan fits, apart)."""
    import torch
    from torch import nn

    torch.backends.cudnn.benchmark = False
    torch.cuda.init()
    observer = Observer(keep_snapshot=False)
    observer.attach()
    device = torch.device("cuda", 0)
    trials: list[dict[str, Any]] = []
    total = torch.cuda.get_device_properties(0).total_memory
    for cin, cout, kernel, batch, size, half, channels_last in HANDLED_CONVS:
        dtype = torch.float16 if half else torch.float32
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        conv = nn.Conv2d(cin, cout, kernel, padding=kernel // 2).to(
            device, dtype, memory_format=fmt
        )
        x = torch.randn(batch, cin, size, size, device=device, dtype=dtype).to(memory_format=fmt)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        out_bytes = batch * cout * size * size * (2 if half else 4)
        segment = -(-out_bytes // (2 * MIB)) * 2 * MIB
        cap = torch.cuda.memory_reserved(0) + segment + MIB  # 1 MiB: no segment fits in it
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
        before = int(_stats().get("num_ooms", 0))
        calls = len(observer.calls)
        t0 = time.time()
        raised = other = ""
        try:
            with torch.no_grad():
                y = conv(x)
            torch.cuda.synchronize()
            del y
        except torch.OutOfMemoryError as exc:
            raised = str(exc).splitlines()[0]
        except RuntimeError as exc:  # no plan fits at all
            other = str(exc).splitlines()[0][:200]
        t1 = time.time()
        after = int(_stats().get("num_ooms", 0))
        trials.append(
            {
                "t0": t0,
                "t1": t1,
                "ooms": after - before,
                "observer_calls": len(observer.calls) - calls,
                "raised": raised,
                "other_error": other,
                "conv": [cin, cout, kernel, batch, size, half, channels_last],
            }
        )
        del x, conv
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()
    time.sleep(0.5)  # one more sample: the agent's count of handled OOMs
    _write(out, {"trials": trials, "observer_attach_error": observer.attach_error})


BACKWARD_WIDTH = 8192


def job_oom_backward(out: str) -> None:
    """An OOM in backward: the forward fits, then the cap is set to what the job holds, so
    the first large gradient, allocated in the autograd engine's device thread, fails. The job
    catches the error at ``loss.backward()``."""
    import torch
    from torch import nn

    observer = Observer(keep_snapshot=False)
    torch.cuda.init()
    observer.attach()
    torch.manual_seed(0)
    device = torch.device("cuda", 0)
    layer = nn.Linear(BACKWARD_WIDTH, BACKWARD_WIDTH).to(device)
    x = torch.randn(BACKWARD_WIDTH, BACKWARD_WIDTH, device=device)
    loss = layer(x).square().mean()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # A small block kept alive: small allocations in the training thread (the root gradient)
    # find room; the engine's large ones do not.
    keep = torch.empty(16, device=device)
    fraction = _cap(torch.cuda.memory_reserved(0) + MIB)
    payload: dict[str, Any] = {"fraction": fraction, "raised": ""}
    try:
        loss.backward()
    except torch.OutOfMemoryError as exc:
        payload["raised"] = str(exc).splitlines()[0]
    payload["caught_at"] = time.time()
    del keep
    payload.update(observer=observer.calls)
    _write(out, payload)


def job_oom_holders(out: str) -> None:
    """What holds the memory at an OOM in backward: a layer trained one step with SGD and
    momentum, its gradients kept (``zero_grad(set_to_none=False)``), then the cap is set to
    what the job holds and the next backward fails in the autograd engine's device thread,
    where the agent reads the parameters, gradients and momentum buffers at the failure. The
    job writes its own arithmetic: each tensor's bytes rounded up to the allocator's 512-byte
    blocks."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    device = torch.device("cuda", 0)
    layer = nn.Linear(BACKWARD_WIDTH, BACKWARD_WIDTH).to(device)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(BACKWARD_WIDTH, BACKWARD_WIDTH, device=device)
    layer(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    loss = layer(x).square().mean()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    keep = torch.empty(16, device=device)

    def blocks(tensors: list[Any]) -> int:
        return sum(-(-t.numel() * t.element_size() // 512) * 512 for t in tensors)

    params = list(layer.parameters())
    payload: dict[str, Any] = {
        "parameters": blocks(params),
        "gradients": blocks([p.grad for p in params]),
        "optimizer_state": blocks([optimizer.state[p]["momentum_buffer"] for p in params]),
        "fraction": _cap(torch.cuda.memory_reserved(0) + MIB),
        "raised": "",
    }
    try:
        loss.backward()
    except torch.OutOfMemoryError as exc:
        payload["raised"] = str(exc).splitlines()[0]
    del keep
    _write(out, payload)


def job_oom_stream(out: str) -> None:
    """A free block on a side stream that the default stream's request would fit in: the
    allocator cannot use it (blocks are per stream), and the segment holding it cannot be
    released (a live block shares it). Under a cap at what the job holds, the request fails."""
    import torch

    observer = Observer(keep_snapshot=False)
    torch.cuda.init()
    observer.attach()
    device = torch.device("cuda", 0)
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        # 4 MiB in a new 20 MiB segment: the other 16 MiB stay free, on the side stream.
        kept = torch.empty(4 * MIB // 4, device=device)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    _cap(torch.cuda.memory_reserved(0) + MIB)
    payload: dict[str, Any] = {"raised": ""}
    try:
        torch.empty(12 * MIB // 4, device=device)  # fits in 16 MiB, on the wrong stream
    except torch.OutOfMemoryError as exc:
        payload["raised"] = str(exc).splitlines()[0]
    del kept
    payload.update(observer=observer.calls)
    _write(out, payload)


def job_oom_huge(out: str) -> None:
    """One allocation larger than the device, caught: an OOM on any allocator backend (the
    GPU check runs it on ``cudaMallocAsync``)."""
    import torch

    torch.cuda.init()
    observer = Observer(keep_snapshot=False)
    observer.attach()
    total = torch.cuda.get_device_properties(0).total_memory
    payload: dict[str, Any] = {"message": "", "backend": ""}
    with contextlib.suppress(Exception):
        payload["backend"] = torch.cuda.get_allocator_backend()
    try:
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as exc:
        payload["message"] = str(exc).splitlines()[0]
    time.sleep(0.5)  # the agent's samples after the failure
    payload.update(
        observer=observer.calls,
        observer_errors=observer.errors,
        observer_attach_error=observer.attach_error,
    )
    _write(out, payload)


FREE_CAP = 4 * GIB
FREE_RESOLUTION = 2 * MIB


def job_free_under_cap(out: str) -> None:
    """Free memory under ``set_per_process_memory_fraction``: 1 GiB held under a 4 GiB cap, the
    cache emptied, memory still for 2 s (the agent samples it); then the largest allocation
    the job can really get is found by trying (to within FREE_RESOLUTION). ``mem_get_info()``
    read in the job shows the device's free memory, far above it."""
    import torch

    torch.cuda.init()
    _cap(FREE_CAP)
    device = torch.device("cuda", 0)
    held = torch.empty(GIB, dtype=torch.uint8, device=device)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(0)
    t0 = time.time()
    time.sleep(2.0)
    t1 = time.time()
    low, high = 0, FREE_CAP
    while high - low > FREE_RESOLUTION:
        middle = (low + high) // 2 // FREE_RESOLUTION * FREE_RESOLUTION
        if middle <= low:
            break
        try:
            probe = torch.empty(middle, dtype=torch.uint8, device=device)
            del probe
            low = middle
        except torch.OutOfMemoryError:
            high = middle
        torch.cuda.empty_cache()
    del held
    plateau = {
        "t0": t0,
        "t1": t1,
        "device": "cuda:0",
        "allocatable": low,
        "resolution": FREE_RESOLUTION,
        "mem_get_info": [int(free), int(total)],
        "cap": FREE_CAP,
    }
    _write(out, {"plateau": plateau})


# --------------------------------------------------------------------------------------------
# op windows
# --------------------------------------------------------------------------------------------

OPS_STEPS = 4


def job_ops(out: str, device_name: str = "cuda") -> None:
    """Explicit op windows of 4 steps each (the sampled ones are paused): ``.item()`` every
    step, one pinned host-to-device copy a step, one pageable copy a step. Then the job's own
    ``torch.profiler`` over the same model: its ``key_averages`` are the truth the agent's
    attribution of kernels to ops is held against, and its events are kept as a fixture.
    ``device_name`` "cpu" runs the same windows without a GPU (no copies, nothing pinned), so
    the tests exercise the job and its windows here."""
    import torch
    from torch import nn
    from torch.profiler import ProfilerActivity, profile

    from torchtop.agent.ops import paused, read_events, window

    # No sampled window from here on (one opened by time while CUDA starts would be open when
    # the explicit ones are asked for); the explicit windows below open all the same.
    sampled_windows = paused()
    sampled_windows.__enter__()
    torch.manual_seed(0)
    cuda = device_name == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    width = 4096 if cuda else 256
    model = nn.Sequential(
        nn.Linear(1024, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x_dev = torch.randn(256, 1024, device=device)
    y_dev = torch.randint(0, 10, (256,), device=device)
    x_pageable = torch.randn(256, 1024)
    x_pinned = x_pageable.pin_memory() if cuda else x_pageable

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    def step(x: Any, item: bool) -> None:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y_dev)
        loss.backward()
        opt.step()
        if item:
            loss.item()

    phases: dict[str, list[float]] = {}
    for _ in range(5):
        step(x_dev, item=True)  # warm-up: cuBLAS handles, the optimizer's state
    synchronize()
    time.sleep(0.5)  # the agent's thread picks the step clock that counts window steps
    for name, source, item, non_blocking in (
        ("item", x_dev, True, False),
        ("pinned", x_pinned, False, True),
        ("pageable", x_pageable, False, False),
    ):
        t0 = time.time()
        # No synchronize inside: it would be one more sync point. The model is small, so
        # the GPU keeps up with the launches and is done when the window closes.
        with window() as opened:
            for _ in range(OPS_STEPS):
                step(source.to(device, non_blocking=non_blocking), item=item)
        synchronize()
        phases[name] = [t0, time.time(), float(opened)]
        time.sleep(0.3)
    queued: dict[str, Any] = {}
    if cuda:
        queued = _queued_window(torch, window)
    time.sleep(1.0)  # the agent's thread reads the windows
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        for _ in range(OPS_STEPS):
            step(x_dev, item=False)
        synchronize()
    sampled_windows.__exit__(None, None, None)
    table = []
    for avg in prof.key_averages():
        self_device = getattr(avg, "self_device_time_total", None)
        if self_device is None:
            self_device = getattr(avg, "self_cuda_time_total", 0)
        table.append(
            {"name": avg.key, "calls": int(avg.count), "self_device_us": float(self_device or 0)}
        )
    events = read_events(prof.profiler.kineto_results, record_shapes=False)
    _write(
        out,
        {
            "phases": phases,
            "queued": queued,
            "steps": OPS_STEPS,
            "key_averages": table,
            "events": [
                {
                    "name": e.name,
                    "start": e.start,
                    "end": e.end,
                    "thread": e.thread,
                    "device": e.device,
                    "correlation": e.correlation,
                    "linked": e.linked,
                }
                for e in events
            ],
        },
    )


QUEUED_SIZE = 8192
QUEUED_MATMULS = 24


def _queued_window(torch: Any, window: Any) -> dict[str, Any]:
    """A window that closes while long kernels still run: matmuls launched inside it and not
    waited for. CUDA events around them measure their device time in the job."""
    a = torch.randn(QUEUED_SIZE, QUEUED_SIZE, device="cuda")
    b = torch.randn(QUEUED_SIZE, QUEUED_SIZE, device="cuda")
    c = torch.empty(QUEUED_SIZE, QUEUED_SIZE, device="cuda")
    torch.matmul(a, b, out=c)  # cuBLAS's handle and workspace, before the window
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.time()
    with window() as opened:
        start.record()
        for _ in range(QUEUED_MATMULS):
            torch.matmul(a, b, out=c)
        end.record()
        launched = time.time()
    end.synchronize()
    return {
        "span": [t0, time.time(), float(opened)],
        "kernel_s": start.elapsed_time(end) / 1000.0,
        "launch_s": launched - t0,
    }


# --------------------------------------------------------------------------------------------
# cost
# --------------------------------------------------------------------------------------------


def job_overhead(out: str, device_name: str = "cuda") -> None:
    """The agent on against off on a GPU training step, in paired blocks (the CPU benchmark's
    method, benchmarks/agent_overhead.py, with the model on the GPU). "cpu": a short run of a
    small model, for the tests."""
    import torch
    from torch import nn

    from benchmarks import agent_overhead

    cuda = device_name == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    width = 4096 if cuda else 64

    def build() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
        model = nn.Sequential(
            nn.Linear(2048, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, 10),
        ).to(device)
        return (
            model,
            torch.randn(512, 2048, device=device),
            torch.randint(0, 10, (512,), device=device),
        )

    make_step = agent_overhead.make_step

    def synced_step(*args: Any) -> Any:
        # Each step waits for its kernels, so a step's time is the GPU's, not the launch's.
        step = make_step(*args)

        def synced() -> None:
            step()
            if cuda:
                torch.cuda.synchronize()

        return synced

    agent_overhead.make_step = synced_step  # type: ignore[assignment]
    rounds, seconds = (12, 0.5) if cuda else (2, 0.2)
    # The cost row reads the ratios only: not the agent's own measure, a minute more.
    result = agent_overhead.measure(
        f"{device_name} mlp", build, rounds=rounds, seconds=seconds, self_measure=False
    )
    _write(out, result)


def job_history(out: str, arm: str) -> None:
    """The time of one allocation and free, with or without the allocator history torchtop
    records (the agent's exact call), in a process of its own (history cannot be turned off
    cleanly)."""
    import torch

    torch.cuda.init()
    if arm == "history":
        torch.cuda.memory._record_memory_history(
            enabled="all", context="alloc", stacks="python", max_entries=10_000
        )
    device = torch.device("cuda", 0)
    for _ in range(2000):
        torch.empty(1024, device=device)
    medians = []
    for _ in range(5):
        n = 4000
        t0 = time.perf_counter()
        for _ in range(n):
            torch.empty(1024, device=device)
        medians.append((time.perf_counter() - t0) / n)
    _write(out, {"arm": arm, "per_alloc_s": statistics.median(medians)})


# --------------------------------------------------------------------------------------------
# collectives
# --------------------------------------------------------------------------------------------

#: All-reduces the collectives job enqueues (then one broadcast), and their lengths in turn.
NCCL_ALL_REDUCES = 12
NCCL_LENGTHS = (1024, 4096, 65536)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def job_collectives(out: str, backend: str = "nccl") -> None:
    """A process group of one rank (``nccl`` on the GPU; ``gloo`` on the CPU for the tests):
    :data:`NCCL_ALL_REDUCES` all-reduces of known lengths and one broadcast, then long enough
    for the agent's reader (once a second) to read them. It writes what it enqueued and its
    own dump of the flight recorder's ring (the NCCL dump where torch has it)."""
    import torch
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    dist.init_process_group(backend, rank=0, world_size=1)
    enqueued = []
    for i in range(NCCL_ALL_REDUCES):
        length = NCCL_LENGTHS[i % len(NCCL_LENGTHS)]
        dist.all_reduce(torch.ones(length, device=device))
        enqueued.append({"op": "all_reduce", "sizes": [[length]]})
    dist.broadcast(torch.ones(8, device=device), 0)
    enqueued.append({"op": "broadcast", "sizes": [[8]]})
    if device.type == "cuda":
        torch.cuda.synchronize()
    time.sleep(3.0)  # NCCL's watchdog marks the completions; the agent reads once a second
    name = "_dump_nccl_trace_json" if hasattr(c10d, "_dump_nccl_trace_json") else None
    name = name or "_dump_fr_trace_json"
    ring = json.loads(bytes(getattr(c10d, name)(True, False)))
    _write(
        out,
        {
            "backend": backend,
            "enqueued": enqueued,
            "dumper": name,
            "ring": ring,
            "buffer": os.environ.get("TORCH_FR_BUFFER_SIZE"),
            "timing": os.environ.get("TORCH_NCCL_ENABLE_TIMING"),
            "torch": torch.__version__,
        },
    )
    dist.destroy_process_group()


JOBS = {
    "allocator": lambda a: job_allocator(a[0]),
    "cpu": lambda a: job_cpu(a[0], *(float(v) for v in a[1:])),
    "visible": lambda a: job_visible(a[0]),
    "oom-full": lambda a: job_oom_full(a[0], catch=len(a) > 1 and a[1] == "catch"),
    "oom-fragmented": lambda a: job_oom_fragmented(a[0]),
    "oom-handled": lambda a: job_oom_handled(a[0]),
    "oom-backward": lambda a: job_oom_backward(a[0]),
    "oom-stream": lambda a: job_oom_stream(a[0]),
    "oom-holders": lambda a: job_oom_holders(a[0]),
    "oom-huge": lambda a: job_oom_huge(a[0]),
    "free": lambda a: job_free_under_cap(a[0]),
    "ops": lambda a: job_ops(a[0], *a[1:]),
    "overhead": lambda a: job_overhead(a[0], *a[1:]),
    "history": lambda a: job_history(a[0], a[1]),
    "collectives": lambda a: job_collectives(a[0], *a[1:]),
}


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in JOBS:
        sys.exit(f"usage: gpu_check_jobs.py {{{','.join(JOBS)}}} OUT.json [ARGS]")
    JOBS[argv[0]](argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
