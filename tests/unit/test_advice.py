"""The advice rules over a model fed with messages: when each finding appears, its evidence,
and when it clears. CUDA memory comes from recorded ``torch.cuda.memory_stats()`` dicts read by
the real probe; op windows are built in the agent's format."""

from __future__ import annotations

import dataclasses
from typing import Any

from fakes.nvml import FakeGpu, FakeNvmlBackend, uuid_of
from test_probes_cuda_memory import FakeCuda, FakeCudaWithProperties, fixture
from test_tui_app import T0, hello

from torchtop.agent.probes.cuda_memory import CudaMemoryProbe
from torchtop.agent.probes.nvml import NvmlProbe
from torchtop.model import JobModel
from torchtop.model.advice import Advisor
from torchtop.protocol import (
    DeviceInfo,
    GpuSample,
    Hello,
    HostStats,
    LoaderInfo,
    LoaderStats,
    MatmulDtype,
    Message,
    OpStat,
    OpsWindow,
    PhaseBegan,
    Sample,
    StepStats,
    WorkerStats,
)

GIB = 1 << 30


def steps(t: float, total: int, n: int, step_s: float, wait_s: float) -> StepStats:
    """``n`` steps of ``step_s`` each ending by ``t``, waiting ``wait_s`` each for data."""
    ends = [t - step_s * (n - 1 - i) for i in range(n)]
    return StepStats(
        t, total, 0, n, 0, n, n * step_s, n * wait_s, 0.0, 0.0, 0,
        ends=ends, durations=[step_s] * n, waits=[wait_s] * n,
    )  # fmt: skip


def loader(batches: int, grad: int, *, workers: int = 0, name: str = "Items", index: int = 0):
    return LoaderStats(
        index, f"loader {index}", name, 8, workers, False, None, False, batches=batches,
        wait_s=1.0, epochs=1, grad_batches=grad,
    )  # fmt: skip


def fed(messages: list[Message]) -> JobModel:
    model = JobModel(mode="replay")
    model.apply(hello(cuda=False))
    model.apply_all(messages)
    return model


def names(model: JobModel) -> list[str]:
    return [f.name for f in model.advice.findings]


def input_job(wait_share: float, seconds: int, start: float = T0) -> list[Message]:
    """Ten 0.1 s steps a second, each waiting ``wait_share`` of it for loader 0."""
    out: list[Message] = []
    for s in range(seconds):
        t = start + s + 1
        out.append(steps(t, 10 * (s + 1), 10, 0.1, 0.1 * wait_share))
        out.append(LoaderInfo(t, [loader(10 * (s + 1), 10 * (s + 1))]))
    return out


def test_input_bound_appears_after_holding_with_severity_by_wait_share_and_clears() -> None:
    model = fed(input_job(0.05, 10))
    assert names(model) == []  # 5%: under the 10% threshold

    model = fed(input_job(0.2, 2))
    assert names(model) == []  # true, but not yet for the 3 s it must hold
    model.apply_all(input_job(0.2, 10, T0 + 2))
    (finding,) = model.advice.findings
    assert (finding.name, finding.severity) == ("input-bound", "warning")
    assert finding.evidence["wait_fraction"] == 0.2 and finding.evidence["num_workers"] == 0
    assert "num_workers=0" in finding.fix and finding.demo == "dataloader"
    assert finding.window_start < finding.window_end == model.now
    assert model.advice.summary() == "1 warning"

    model.apply_all(input_job(0.5, 12, T0 + 12))
    assert [f.severity for f in model.advice.findings] == ["critical"]
    assert model.advice.findings[0].first_t == finding.first_t  # the same finding, worse

    model.apply_all(input_job(0.0, 15, T0 + 24))  # the fix applied: it clears
    assert names(model) == []
    (cleared,) = model.advice.cleared
    assert cleared.name == "input-bound" and not cleared.active
    # The recent window is 10 s: the last 50% waits leave it at about T0 + 33.
    assert cleared.first_t == finding.first_t and T0 + 24 < cleared.last_t <= T0 + 34


def test_findings_are_the_same_fed_at_once_or_message_by_message() -> None:
    messages = [*input_job(0.4, 8), *input_job(0.0, 15, T0 + 8)]
    whole = fed(messages)
    split = JobModel(mode="live")
    split.apply(hello(cuda=False))
    for message in messages:
        split.apply(message)
    assert [f.to_json() for f in whole.advice.all_findings] == [
        f.to_json() for f in split.advice.all_findings
    ]
    assert len(whole.advice.all_findings) == 1


def creep_job(
    per_step: int, n: int = 320, every: int = 1, rising: int | None = None
) -> list[Message]:
    """``n`` steps of 0.1 s (the first 20 s are the warm-up, not creep), four memory samples
    in each ``every``-th step (none in the others: steps faster than the sampling); RSS climbs
    by ``per_step`` each of the first ``rising`` steps (all of them by default), then holds."""
    out: list[Message] = []
    for i in range(n):
        for k in range(4 if i % every == 0 else 0):
            t = T0 + i * 0.1 + k * 0.025
            grown = i if rising is None else min(i, rising)
            rss = 500 * (1 << 20) + grown * per_step + (k % 2) * (8 << 20)
            host = HostStats(rss, 50.0, 4, 0, 100 * GIB, 200 * GIB)
            memory = [dataclasses.replace(_cpu, allocated_bytes=rss // 2, reserved_bytes=rss)]
            out.append(Sample(t, host, memory))
        out.append(steps(T0 + (i + 1) * 0.1, i + 1, 1, 0.1, 0.0))
    return out


_cpu: Any = None


def setup_module() -> None:
    global _cpu
    from torchtop.protocol import MemoryStats

    _cpu = MemoryStats("cpu", "cpu-heap", 0, 0)


def test_memory_creep_over_fifty_steps_and_not_for_flat_or_short_runs() -> None:
    model = fed(creep_job(2 << 20))
    (finding,) = model.advice.findings
    assert finding.name == "memory-creep" and finding.demo == "memory"
    assert finding.evidence["steps"] >= 50 and finding.evidence["per_step_bytes"] >= 1 << 20
    assert fed(creep_job(0)).advice.findings == []
    # RSS warming up (the C heap's arenas, batches mapped in from workers): 44 MiB over 300
    # steps, under 10% of the 500 MiB it started at, is no creep on a CPU job.
    assert fed(creep_job(150 << 10, n=300)).advice.findings == []
    assert fed(creep_job(2 << 20, n=40)).advice.findings == []  # fewer than 50 steps
    assert fed(creep_job(2 << 20, n=80)).advice.all_findings == []  # 80 steps, but only 8 s


def test_memory_that_grows_for_a_moment_then_holds_is_no_creep() -> None:
    """DataLoader workers starting, a cache filling: 60 steps of growth (6 s, 120 MiB), then
    flat. The last 400 steps' floors rose in all, but not chunk after chunk."""
    assert fed(creep_job(2 << 20, n=400, rising=60)).advice.all_findings == []  # never, not once
    (finding,) = fed(creep_job(2 << 20, n=400, rising=400)).advice.findings
    assert finding.name == "memory-creep"


def test_memory_creep_when_steps_outrun_the_sampling() -> None:
    """One step in eight sampled (a fast job, or a loaded machine): the sampled steps' floors
    stand for all the steps, and the rise per step is over every step."""
    (finding,) = fed(creep_job(2 << 20, every=8)).advice.findings
    assert finding.name == "memory-creep"
    assert finding.evidence["steps"] >= 100 and 15 <= finding.evidence["sampled_steps"] <= 30
    assert 1.5 * (1 << 20) <= finding.evidence["per_step_bytes"] <= 2 << 20
    assert fed(creep_job(0, every=8)).advice.findings == []
    assert fed(creep_job(2 << 20, every=30)).advice.findings == []  # 4 sampled: too few


def test_eval_with_grad_from_a_loader_iterated_without_steps() -> None:
    messages: list[Message] = []
    for s in range(6):  # training: loader 0 with steps
        t = T0 + s + 1
        messages += [steps(t, 10 * (s + 1), 10, 0.1, 0.0), LoaderInfo(t, [loader(10 * s, 10 * s)])]
    for s in range(6, 9):  # validation: loader 1, no steps
        t = T0 + s + 1
        messages.append(
            LoaderInfo(t, [loader(60, 60), loader(20 * (s - 5), 20 * (s - 5), index=1)])
        )
    model = fed(messages)
    (finding,) = model.advice.findings
    assert finding.name == "eval-with-grad" and finding.evidence["loader"] == "loader 1"
    assert finding.evidence["grad_batches"] == 20 and "inference_mode" in (finding.code or "")

    no_grad = [
        m
        if not isinstance(m, LoaderInfo) or len(m.loaders) == 1
        else LoaderInfo(m.t, [m.loaders[0], dataclasses.replace(m.loaders[1], grad_batches=0)])
        for m in messages
    ]
    assert fed(no_grad).advice.findings == []


def test_eval_with_grad_when_the_last_steps_are_reported_after_the_evaluation_began() -> None:
    """A recorded job on a loaded machine: steps come in frames every half second, the loaders'
    counts every second. The last training steps (ended by 1.8 s) arrived at 2.08 s, after the
    reading at 1.88 s that counted the evaluation loader's first 6 batches; by report, loader 1
    then advanced alone (6 -> 47) while 13 steps were "taken", and was held a training loader."""
    frames = [(0.52, 1, 19, 0.5), (1.04, 19, 29, 1.0), (1.56, 29, 47, 1.5), (2.08, 47, 60, 1.8)]
    # The advisor evaluates once a second of the job's time, here at 1.95 s and 2.95 s.
    messages: list[Message] = [Sample(T0 - 0.05 + i / 10, None, []) for i in range(80)]
    for t, before, total, last_end in frames:
        n = total - before
        s = steps(T0 + t, total, n, 0.012, 0.0)
        messages.append(
            dataclasses.replace(s, ends=[T0 + last_end - 0.012 * (n - 1 - i) for i in range(n)])
        )
    messages.append(LoaderInfo(T0 + 0.88, [loader(26, 26)]))
    for t, evaluated in [(1.88, 6), (2.90, 47), (3.90, 82), (4.92, 107), (5.94, 133), (6.96, 169)]:
        messages.append(LoaderInfo(T0 + t, [loader(60, 60), loader(evaluated, evaluated, index=1)]))
    messages.sort(key=lambda m: m.t)  # type: ignore[attr-defined]
    model = fed(messages)
    assert names(model) == ["eval-with-grad"]
    assert model.advice.findings[0].evidence["loader"] == "loader 1"


def test_a_loader_first_reported_after_its_steps_is_no_evaluation_when_steps_stop() -> None:
    """A DDP rank stuck in a hang: its 5 steps arrive at one evaluation, the loader's first
    report (its 6 batches, all fetched while those steps ran) at the next, and no step after.
    The batches were not taken "without a step meanwhile": they are the loader's start."""
    messages: list[Message] = [Sample(T0 + i / 10, None, []) for i in range(1, 80)]
    messages += [steps(T0 + 0.6, 1, 1, 0.1, 0.0), steps(T0 + 1.0, 5, 4, 0.1, 0.0)]
    messages += [LoaderInfo(T0 + 1.3 + s, [loader(6, 6)]) for s in range(6)]
    messages.sort(key=lambda m: m.t)  # type: ignore[attr-defined]
    model = fed(messages)
    assert model.advice.all_findings == []
    # A loader that goes on without steps after its first report is still found.
    more = [LoaderInfo(T0 + 8 + s, [loader(6 + 4 * s, 6 + 4 * s)]) for s in range(1, 4)]
    more += [Sample(T0 + 8 + i / 10, None, []) for i in range(1, 40)]
    model.apply_all(sorted(more, key=lambda m: m.t))  # type: ignore[attr-defined]
    assert names(model) == ["eval-with-grad"]


def test_eval_with_grad_in_an_eval_phase_even_while_steps_go_on() -> None:
    messages: list[Message] = [PhaseBegan(T0 + 0.5, "validate", 1)]
    for s in range(4):
        t = T0 + s + 1
        messages += [steps(t, 10 * (s + 1), 10, 0.1, 0.0), LoaderInfo(t, [loader(8 * s, 8 * s)])]
    assert names(fed(messages)) == ["eval-with-grad"]


def cuda_samples(stats: dict[str, Any], seconds: int = 8) -> JobModel:
    (memory,) = CudaMemoryProbe(FakeCuda([stats])).read()
    model = JobModel(mode="replay")
    model.apply(hello(cuda=True))
    for i in range(seconds * 10):
        model.apply(Sample(T0 + i / 10, None, [memory]))
    return model


def test_pressure_and_fragmentation_from_recorded_cuda_stats() -> None:
    # After an OOM on an H200: 145 of 150.8 GB reserved at peak, 3 allocation retries.
    after_oom = cuda_samples(fixture("after_oom"))
    assert names(after_oom) == ["memory-pressure", "fragmentation"]
    pressure, frag = after_oom.advice.findings
    assert pressure.evidence["share"] >= 0.9 and pressure.demo == "checkpointing"
    assert frag.evidence["alloc_retries"] == 3 and "expandable_segments" in (frag.code or "")

    # The same device in use without waste: 80% of what is reserved is allocated, no retries.
    healthy = fixture("idle_after_training")
    healthy["allocated_bytes.all.current"] = int(0.8 * healthy["reserved_bytes.all.current"])
    assert cuda_samples(healthy).advice.findings == []


def ops_window(*, device: bool, syncs: int, ops: list[OpStat], steps: int = 10) -> OpsWindow:
    return OpsWindow(
        T0 + 5, 1, T0 + 4, 1.0, steps, 0.01, 30.0, device, syncs, 0, ops, steps, 1.0, syncs, 0,
        ops,
    )  # fmt: skip


def test_host_syncs_on_a_cuda_job_only() -> None:
    item = OpStat("aten::item", 10, 0.002, 0.0001, site="train.py:42")
    ops = [item, OpStat("aten::addmm", 30, 0.03, 0.03, 0.02, 0.02)]
    model = fed([ops_window(device=True, syncs=10, ops=ops)])
    (finding,) = model.advice.findings
    assert finding.name == "host-syncs" and finding.evidence["sync_points_per_step"] == 1.0
    assert "aten::item at train.py:42" in finding.summary and finding.demo == "device"
    # Read every 10 steps: 0.1 per step.
    assert fed([ops_window(device=True, syncs=1, ops=ops)]).advice.findings == []
    assert fed([ops_window(device=False, syncs=10, ops=ops)]).advice.findings == []


def test_tiny_ops_when_most_op_time_is_in_ops_of_a_few_microseconds() -> None:
    tiny = [OpStat(f"aten::op{i}", 2000, 0.02, 0.02) for i in range(3)]  # 10 µs each
    model = fed(
        [ops_window(device=False, syncs=0, ops=[*tiny, OpStat("aten::mm", 10, 0.01, 0.01)])]
    )
    (finding,) = model.advice.findings
    assert finding.name == "tiny-ops" and finding.demo == "vectorization"
    assert finding.evidence["ops_per_step"] >= 100 and finding.evidence["tiny_op_share"] >= 0.5
    # One window of two steps is a glimpse, not the evidence of three windows.
    small_model = [OpStat(f"aten::op{i}", 500, 0.005, 0.005) for i in range(3)]  # 150 a step
    assert fed([ops_window(device=False, syncs=0, ops=small_model)]).advice.findings == []
    glimpse = ops_window(device=False, syncs=0, ops=[*tiny, OpStat("aten::mm", 10, 0.01, 0.01)])
    assert fed([dataclasses.replace(glimpse, total_steps=2)]).advice.findings == []
    vectorized = [OpStat("aten::mm", 10, 0.05, 0.05), OpStat("aten::add", 20, 0.001, 0.001)]
    assert fed([ops_window(device=False, syncs=0, ops=vectorized)]).advice.findings == []


def test_summary_counts_by_severity() -> None:
    advisor = Advisor()
    assert advisor.summary() == ""
    model = cuda_samples(fixture("after_oom"))
    assert model.advice.summary() == "2 warnings"


def cuda_hello() -> Hello:
    """The hello of a job on an H200, its device read by the real probe from CUDA's
    properties (compute capability 9.0: tensor cores)."""
    devices = CudaMemoryProbe(FakeCudaWithProperties([fixture("after_oom")])).devices()
    return dataclasses.replace(hello(cuda=False), devices=[DeviceInfo("cpu", "cpu"), *devices])


def matmul_window(dtypes: dict[str, int], *, device: bool = True) -> OpsWindow:
    """An op window whose matmuls took these input dtypes (as the profiler names them)."""
    counts = [MatmulDtype(d, n) for d, n in dtypes.items()]
    window = ops_window(device=device, syncs=0, ops=[OpStat("aten::addmm", 30, 0.03, 0.03)])
    return dataclasses.replace(window, matmuls=counts, total_matmuls=counts)


def cuda_fed(messages: list[Message], first: Hello | None = None) -> JobModel:
    model = JobModel(mode="replay")
    model.apply(first or cuda_hello())
    model.apply_all(messages)
    return model


def test_float32_matmuls_on_a_tensor_core_gpu_without_autocast() -> None:
    model = cuda_fed([matmul_window({"float": 120})])
    (finding,) = model.advice.findings
    assert (finding.name, finding.demo) == ("float32-matmuls", "mixed-precision")
    assert finding.evidence["float32_share"] == 1.0 and finding.evidence["capability"] == "9.0"
    assert "bfloat16" in (finding.code or "") and "NVIDIA H200" in finding.summary

    # Under bf16 autocast the matmuls take bf16 inputs; a few float32 ones (a loss) remain.
    assert cuda_fed([matmul_window({"c10::BFloat16": 120, "float": 6})]).advice.findings == []
    # A CPU job, a GPU without tensor cores, and too few sampled calls: nothing to say.
    assert cuda_fed([matmul_window({"float": 120}, device=False)]).advice.findings == []
    pascal = dataclasses.replace(
        cuda_hello(), devices=[DeviceInfo("cuda:0", "Tesla P100", 16 * GIB, capability="6.0")]
    )
    assert cuda_fed([matmul_window({"float": 120})], pascal).advice.findings == []
    assert cuda_fed([matmul_window({"float": 4})]).advice.findings == []


def threads_job(torch_threads: int, workers_cpu: list[float], cpus: int = 8) -> list[Message]:
    """Ten seconds of steps, a host sample a second with ``cpus`` CPUs, a loader whose
    workers run at ``workers_cpu`` percent, and an op window saying ``torch_threads``."""
    out: list[Message] = []
    workers = [WorkerStats(100 + i, True, cpu) for i, cpu in enumerate(workers_cpu)]
    for s in range(10):
        t = T0 + s + 1
        host = HostStats(GIB, 100.0, 12, len(workers), 100 * GIB, 200 * GIB, cpus=cpus)
        out += [Sample(t, host, []), steps(t, 10 * (s + 1), 10, 0.1, 0.0)]
        out.append(
            LoaderInfo(t, [dataclasses.replace(loader(10 * s, 0, workers=len(workers)),
                                               workers=workers)])
        )  # fmt: skip
        if s == 1:
            window = ops_window(device=False, syncs=0, ops=[OpStat("aten::mm", 10, 0.05, 0.05)])
            out.append(dataclasses.replace(window, t=t, torch_threads=torch_threads))
    return out


def test_cpu_oversubscription_by_threads_alone_or_with_busy_workers() -> None:
    (finding,) = fed(threads_job(32, [])).advice.findings
    assert (finding.name, finding.severity) == ("cpu-oversubscription", "warning")
    assert finding.evidence == {"torch_threads": 32, "processes": 1, "busy_workers": 0, "cpus": 8}
    assert "set_num_threads(8)" in (finding.code or "")

    # Six busy workers (an idle one does not count) and 4 threads on 8 CPUs: they compete.
    (finding,) = fed(threads_job(4, [95.0] * 6 + [3.0])).advice.findings
    assert (finding.name, finding.severity) == ("cpu-oversubscription", "info")
    assert finding.evidence["busy_workers"] == 6 and "set_num_threads(2)" in (finding.code or "")

    # The threads fit beside the workers; one thread per process with four ranks on 8 CPUs.
    assert fed(threads_job(2, [95.0] * 6)).advice.findings == []
    ranks = [
        dataclasses.replace(m, host=dataclasses.replace(m.host, local_processes=4))
        if isinstance(m, Sample) and m.host is not None
        else m
        for m in threads_job(4, [])
    ]
    assert names(fed(ranks)) == ["cpu-oversubscription"]
    assert fed(threads_job(2, [])).advice.findings == []


def on_node(messages: list[Message], processes: int) -> list[Message]:
    """``messages`` from one of ``processes`` ranks on the node."""
    return [
        dataclasses.replace(m, host=dataclasses.replace(m.host, local_processes=processes))
        if isinstance(m, Sample) and m.host is not None
        else m
        for m in messages
    ]


def test_one_thread_per_process_blames_the_processes_per_core_never_the_threads() -> None:
    # Four ranks on 2 CPUs, each already at torch.set_num_threads(1).
    (finding,) = fed(on_node(threads_job(1, [], cpus=2), 4)).advice.findings
    assert (finding.name, finding.severity) == ("cpu-oversubscription", "warning")
    assert "set_num_threads" not in (finding.code or "") + finding.fix
    assert "4 processes" in finding.summary and "2 CPUs" in finding.summary
    assert "processes" in finding.title and "threads" not in finding.title
    assert finding.evidence["processes_per_cpu"] == 2.0
    assert finding.demo_command == "" and finding.to_json()["demo_command"] is None
    # As many single-threaded processes as cores: nothing to say.
    assert fed(on_node(threads_job(1, [], cpus=4), 4)).advice.findings == []
    # Two threads each for four ranks on 4 CPUs: the threads are still the fix.
    (finding,) = fed(on_node(threads_job(2, [], cpus=4), 4)).advice.findings
    assert "set_num_threads(1)" in (finding.code or "")


def util_job(util: float, *, wait_share: float = 0.0, seconds: int = 20) -> list[Message]:
    """Steps for ``seconds`` and a GPU sample a second from the real NVML probe over a fake
    H200 the job uses, busy ``util`` percent."""
    gpu = FakeGpu(util_gpu=util, uuid=uuid_of(0))
    probe = NvmlProbe(FakeNvmlBackend([gpu, FakeGpu(util_gpu=99.0, uuid=uuid_of(1))]),
                      job_uuids=lambda: [uuid_of(0)])  # fmt: skip
    out: list[Message] = []
    for message in input_job(wait_share, seconds):
        out.append(message)
        if isinstance(message, StepStats):
            out.append(GpuSample(message.t, probe.read()))
    return out


def test_low_gpu_utilization_while_steps_run_names_the_cause_that_holds() -> None:
    model = cuda_fed(util_job(30.0))
    (finding,) = model.advice.findings
    assert (finding.name, finding.evidence["util_percent"]) == ("low-gpu-utilization", 30.0)
    assert finding.evidence["gpus"] == [0] and finding.evidence["causes"] == []
    assert finding.demo == "profiling"

    # The same GPU idle because the steps wait for data: the input-bound finding is the cause.
    model = cuda_fed(util_job(30.0, wait_share=0.4))
    assert names(model) == ["input-bound", "low-gpu-utilization"]
    low = model.advice.findings[1]
    assert low.evidence["causes"] == ["input-bound"] and low.demo == "dataloader"
    assert "input-bound" in low.summary

    # Busy (another job's GPU at 99% does not count for this one), or idle with no steps.
    assert cuda_fed(util_job(85.0)).advice.findings == []
    no_steps = [m for m in util_job(30.0) if not isinstance(m, StepStats)]
    assert cuda_fed(no_steps).advice.findings == []


# -- false alarms on a CPU job --------------------------------------------------------------------


def workers_job(cpus: int, *, seconds: int = 12) -> list[Message]:
    """``input_job`` waiting 15% of each step for a loader with two workers, on ``cpus``."""
    out: list[Message] = []
    for message in input_job(0.15, seconds):
        if isinstance(message, LoaderInfo):
            message = LoaderInfo(
                message.t, [loader(s.batches, 0, workers=2) for s in message.loaders]
            )
            host = HostStats(300 << 20, 100.0, 8, 2, 4 * GIB, 8 * GIB, cpus=cpus)
            out.append(Sample(message.t, host, []))
        out.append(message)
    return out


def test_input_bound_on_a_cpu_job_fixes_without_pinned_memory_and_within_its_cores() -> None:
    """Pinned memory speeds a copy to a GPU there is not; workers beyond the cores (less the
    training process's own) only take turns."""
    (finding,) = fed(workers_job(cpus=2)).advice.findings
    assert finding.name == "input-bound"
    assert finding.code is not None and "pin_memory" not in finding.code, finding.code
    assert "pin" not in finding.fix
    assert "num_workers=2" in finding.code  # no more than the 2 it has on 2 cores
    # The same job with a GPU and 16 cores: pinned memory and more workers.
    (finding,) = cuda_fed(workers_job(cpus=16)).advice.findings
    assert finding.code is not None and "pin_memory=True" in finding.code
    assert "num_workers=4" in finding.code


def test_memory_that_grows_through_a_warm_up_is_no_creep() -> None:
    """A CPU job with DataLoader workers: RSS climbs about 80 MiB over its first 15 s while
    the workers start and the allocator warms up, then holds."""
    model = fed(creep_job(540 << 10, n=500, rising=150))
    assert model.advice.all_findings == []


def test_a_finding_that_flaps_is_one_finding_with_its_periods() -> None:
    from torchtop.report.job import finding_parts

    model = fed([*input_job(0.5, 10), *input_job(0.0, 14, T0 + 10), *input_job(0.5, 10, T0 + 24)])
    (finding,) = model.advice.all_findings
    assert finding.name == "input-bound" and finding.active
    assert len(finding.periods) == 2
    (first_start, first_end), (second_start, second_end) = finding.periods
    assert finding.first_t == first_start < first_end < second_start < second_end
    assert second_end == finding.last_t
    as_json = finding.to_json(T0)
    assert len(as_json["periods_s"]) == 2
    (text,) = [part.plain for part in finding_parts([as_json])[1:]]
    assert text.count("Input-bound") == 1
    assert f"{first_start - T0:.1f}-{first_end - T0:.1f} s" in text
    assert f"from {second_start - T0:.1f} s, still true at the end" in text


def cow_job(
    uss_mb: list[int],
    *,
    start_method: str = "fork",
    epochs: list[int] | None = None,
    storage: tuple[str, str] | None = None,
):
    """Two workers of loader 0, read once a second, each with ``uss_mb[s]`` MiB private;
    ``storage``: what the agent said the dataset holds."""
    out: list[Message] = []
    for s, mb in enumerate(uss_mb):
        workers = [WorkerStats(100 + w, True, uss_bytes=mb << 20) for w in range(2)]
        stats = dataclasses.replace(
            loader(10 * s, 0, workers=2, name="RowsDataset"),
            start_method=start_method,
            epochs=epochs[s] if epochs else 1,
            workers=workers,
            dataset_storage=storage[0] if storage else None,
            dataset_detail=storage[1] if storage else None,
        )
        out += [steps(T0 + s, 10 * (s + 1), 10, 0.1, 0.0), LoaderInfo(T0 + s, [stats])]
    return out


def test_worker_copy_on_write_when_forked_workers_grow_private_memory() -> None:
    growing = [40 + 30 * s for s in range(10)]  # 40 -> 310 MiB per worker
    model = fed(cow_job(growing))
    assert "worker-copy-on-write" in names(model)
    (finding,) = [f for f in model.advice.findings if f.name == "worker-copy-on-write"]
    ev = finding.evidence
    assert ev["uss_first_bytes"] == 40 << 20 and ev["growth_bytes"] >= 200 << 20
    assert "NumPy" in finding.fix and "spawn" in finding.fix
    assert "worker-copy-on-write" not in names(fed(cow_job([40] * 10)))  # a shared array
    assert "worker-copy-on-write" not in names(fed(cow_job(growing, start_method="spawn")))
    # Growth is read within one epoch: 40 -> 280 MiB across two, but 50 MiB within the second.
    two = [40, 100, 160, 220, 230, 240, 250, 260, 270, 280]
    assert "worker-copy-on-write" in names(fed(cow_job(two)))
    assert "worker-copy-on-write" not in names(fed(cow_job(two, epochs=[1] * 4 + [2] * 6)))


def test_worker_copy_on_write_rests_on_what_the_dataset_holds() -> None:
    growing = [40 + 30 * s for s in range(10)]
    python = ("python", "list of 1,200,000 dict in .rows")
    model = fed(cow_job(growing, storage=python))
    (finding,) = [f for f in model.advice.findings if f.name == "worker-copy-on-write"]
    assert finding.evidence["dataset_storage"] == "python"
    assert finding.evidence["dataset_holds"] == "list of 1,200,000 dict in .rows"
    assert finding.summary.endswith("; the dataset holds a list of 1,200,000 dict in .rows")
    # The same growth over a dataset of arrays is not copy-on-write of the dataset.
    arrays = ("arrays", "numpy.ndarray in .rows")
    assert "worker-copy-on-write" not in names(fed(cow_job(growing, storage=arrays)))
