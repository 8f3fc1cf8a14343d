"""The exporters on scripted messages: names, labels and values; the HTTP server's limits; the
OTLP path through the SDK's in-memory reader; the CLI's options."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import SCRIPTS, torchtop
from torchtop.export.families import families
from torchtop.export.figures import JobFigures, figures_of
from torchtop.export.prometheus import (
    MAX_CONNECTIONS,
    MetricsError,
    MetricsServer,
    parse_address,
    registry_for,
)
from torchtop.export.service import JobSet, _exported_job
from torchtop.model.job import JobModel
from torchtop.protocol import (
    DeviceInfo,
    GpuSample,
    GpuStats,
    Hello,
    HostStats,
    MemoryStats,
    Message,
    OutOfMemory,
    Sample,
    StepStats,
)
from torchtop.transport import AgentInfo, find_agent

UUID0 = "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52"
UUID1 = "GPU-11111111-2222-3333-4444-555555555555"
T0 = 1_700_000_000.0
MIB = 1 << 20


def hello(rank: int | None = None, pid: int = 100) -> Hello:
    return Hello(
        protocol=1,
        pid=pid,
        argv=["train.py"],
        cwd="/",
        started_at=T0,
        python="3.11",
        torch="2.13.0",
        devices=[
            DeviceInfo("cpu", "x86_64"),
            DeviceInfo("cuda:0", "NVIDIA H200", 150 << 30, uuid=UUID0),
            DeviceInfo("cuda:1", "NVIDIA H200", 150 << 30, uuid=UUID1),
        ],
        interval_s=0.1,
        hostname="node7",
        rank=rank,
        local_rank=None if rank is None else rank % 8,
        world_size=None if rank is None else 16,
        run_id=None if rank is None else "job-42",
    )


def cuda(
    device: str, allocated: int, *, retries: int = 0, ooms: int = 0, handled: int = 0
) -> MemoryStats:
    return MemoryStats(
        device=device,
        source="cuda",
        allocated_bytes=allocated,
        reserved_bytes=allocated + 64 * MIB,
        peak_allocated_bytes=allocated + 32 * MIB,
        num_alloc_retries=retries,
        num_ooms=ooms,
        handled_ooms=handled,
    )


def steps(t: float, total: int, timed: int, time_s: float, wait_s: float) -> StepStats:
    return StepStats(
        t=t, total=total, skipped_total=0, count=timed, skipped=0, timed=timed,
        time_s=time_s, wait_s=wait_s, startup_s=0.0, optimizer_s=0.0, samples=0,
    )  # fmt: skip


def oom(t: float, device: str) -> OutOfMemory:
    return OutOfMemory(
        t=t, id=1, device=device, emulated=False, requested_bytes=MIB, free_bytes=0,
        total_bytes=None, reserved_bytes=None, allocated_bytes=None,
        largest_free_block_bytes=None, fragmented=None, top_sites=[], snapshot_path=None,
    )  # fmt: skip


def job_messages(rank: int | None = 3) -> list[Message]:
    host = HostStats(3 * 1 << 30, 100.0, 12, 0, None, None)
    return [
        hello(rank),
        Sample(T0 + 1, host, [cuda("cuda:0", 100 * MIB), cuda("cuda:1", 10 * MIB)]),
        steps(T0 + 1, total=10, timed=9, time_s=0.9, wait_s=0.18),
        oom(T0 + 1.5, "cuda:0"),
        Sample(T0 + 2, host, [cuda("cuda:0", 200 * MIB, retries=2, ooms=1)]),
        # cuDNN's workspace search failed twice and retried smaller: the job never saw those.
        Sample(T0 + 2, host, [cuda("cuda:1", 10 * MIB, ooms=2, handled=2)]),
        steps(T0 + 2, total=20, timed=10, time_s=1.1, wait_s=0.2),
        # NVML's energy counter on cuda:0 (mJ since driver load); cuda:1 has none.
        GpuSample(T0 + 1, [gpu(0, UUID0, 9_284_771_305), gpu(1, UUID1, None)]),
        GpuSample(T0 + 2, [gpu(0, UUID0, 9_285_383_705), gpu(1, UUID1, None)]),
    ]


def gpu(index: int, uuid: str, energy_mj: int | None) -> GpuStats:
    return GpuStats(
        index, "NVIDIA H200", uuid=uuid, cuda_device=f"cuda:{index}", in_job=True,
        energy_mj=energy_mj, energy_supported=energy_mj is not None,
    )  # fmt: skip


def model_of(messages: list[Message]) -> JobModel:
    model = JobModel()
    model.apply_all(messages)
    return model


def exposition(snapshots: list[JobFigures]) -> str:
    return generate_latest(registry_for(lambda: snapshots)).decode()


def values(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def labels(**extra: str) -> frozenset[tuple[str, str]]:
    base = {"run": "job-42", "rank": "3", "local_rank": "3", "hostname": "node7"}
    return frozenset({**base, **extra}.items())


def test_a_ranks_figures_under_prometheus_names_and_dcgm_labels() -> None:
    snap = figures_of(model_of(job_messages()))
    assert snap is not None
    got = values(exposition([snap]))
    gpu0 = labels(device="cuda:0", UUID=UUID0)
    gpu1 = labels(device="cuda:1", UUID=UUID1)
    assert got[("torchtop_steps_total", labels())] == 20
    assert got[("torchtop_step_duration_seconds_count", labels())] == 19
    assert got[("torchtop_step_duration_seconds_sum", labels())] == pytest.approx(2.0)
    assert got[("torchtop_dataloader_wait_seconds_total", labels())] == pytest.approx(0.38)
    assert got[("torchtop_host_rss_bytes", labels())] == 3 << 30
    assert got[("torchtop_last_sample_timestamp_seconds", labels())] == T0 + 2
    # The gauges are the latest sample's; a device missing from it keeps its last reading.
    assert got[("torchtop_cuda_memory_allocated_bytes", gpu0)] == 200 * MIB
    assert got[("torchtop_cuda_memory_reserved_bytes", gpu0)] == 264 * MIB
    assert got[("torchtop_cuda_memory_peak_bytes", gpu0)] == 232 * MIB
    assert got[("torchtop_cuda_memory_allocated_bytes", gpu1)] == 10 * MIB
    assert got[("torchtop_cuda_alloc_retries_total", gpu0)] == 2
    assert got[("torchtop_ooms_total", gpu0)] == 1
    assert got[("torchtop_ooms_total", gpu1)] == 0
    # Joules since the first reading, under DCGM's UUID; none for a GPU without the counter.
    assert got[("torchtop_gpu_energy_joules_total", gpu0)] == pytest.approx(612.4)
    assert ("torchtop_gpu_energy_joules_total", gpu1) not in got
    names = {name for name, _ in got}
    # Nothing that DCGM exports, and no label per step, op or phase.
    assert not any(w in n for n in names for w in ("util", "temperature", "power"))
    assert all(
        set(dict(lbl)) <= {"run", "rank", "local_rank", "hostname", "device", "UUID"}
        for _, lbl in got
    )


def test_an_oom_on_a_device_never_sampled_is_still_counted() -> None:
    snap = figures_of(model_of([hello(3), oom(T0 + 1, "cuda:1")]))
    assert snap is not None
    got = values(exposition([snap]))
    assert got[("torchtop_ooms_total", labels(device="cuda:1", UUID=UUID1))] == 1
    assert not any(name.startswith("torchtop_cuda_memory") for name, _ in got)


def test_a_single_process_has_no_rank_and_its_pid_names_the_run() -> None:
    snap = figures_of(model_of(job_messages(rank=None)))
    assert snap is not None
    text = exposition([snap])
    steps_total = [line for line in text.splitlines() if line.startswith("torchtop_steps_total")]
    assert steps_total == [
        'torchtop_steps_total{hostname="node7",local_rank="",rank="",run="100"} 20.0'
    ]


def test_several_ranks_are_several_series() -> None:
    jobs = [model_of([hello(rank, pid=100 + rank), *job_messages()[1:]]) for rank in range(4)]
    snaps = [s for s in map(figures_of, jobs) if s is not None]
    got = values(exposition(snaps))
    ranks = {dict(lbl)["rank"] for name, lbl in got if name == "torchtop_steps_total"}
    assert ranks == {"0", "1", "2", "3"}


def test_a_job_before_its_hello_exports_nothing() -> None:
    assert figures_of(JobModel()) is None
    assert all(not f.points for f in families([]))


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_exposition_of_a_gpu_job() -> None:
    snaps = [s for s in [figures_of(model_of(job_messages()))] if s is not None]
    lint = subprocess.run(
        ["promtool", "check", "metrics"], input=exposition(snaps), capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr


# -- the HTTP server ----------------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    snap = figures_of(model_of(job_messages()))
    assert snap is not None
    srv = MetricsServer(registry_for(lambda: [snap])).start()
    yield srv
    srv.close()


def fetch(url: str, accept: str = "") -> tuple[int, str, str]:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, "", ""


def test_the_server_binds_loopback_and_picks_a_free_port(server: MetricsServer) -> None:
    assert server.host == "127.0.0.1" and server.port > 0
    status, content_type, body = fetch(server.url)
    assert status == 200 and content_type.startswith("text/plain")
    assert "torchtop_steps_total" in body
    # Prometheus asks for OpenMetrics; it gets it.
    status, content_type, body = fetch(server.url, "application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith("# EOF")
    assert fetch(server.url.replace("/metrics", "/other"))[0] == 404


def test_hanging_and_excess_connections_cost_only_themselves(server: MetricsServer) -> None:
    threads = threading.active_count()
    hanging = []
    try:
        for _ in range(MAX_CONNECTIONS + 20):
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never finishes the request
            hanging.append(s)
        deadline = time.monotonic() + 30
        while server.refused == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        # Past the limit, connections are closed unanswered: no thread for each.
        assert server.refused > 0
        assert threading.active_count() <= threads + MAX_CONNECTIONS
    finally:
        for s in hanging:
            s.close()
    # Once they are gone, a scrape is answered again.
    deadline = time.monotonic() + 10
    while True:
        try:
            assert fetch(server.url)[0] == 200
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_figure_that_fails_fails_that_scrape_only() -> None:
    calls = []

    def read() -> list[JobFigures]:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a model in a state nobody foresaw")
        snap = figures_of(model_of(job_messages()))
        assert snap is not None
        return [snap]

    srv = MetricsServer(registry_for(read)).start()
    try:
        assert fetch(srv.url)[0] == 500
        status, _, body = fetch(srv.url)
        assert status == 200 and "torchtop_steps_total" in body
    finally:
        srv.close()


def test_a_port_in_use_is_one_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MetricsError, match=r"127\.0\.0\.1:\d+: .*pick another port"):
            MetricsServer(registry_for(list), "127.0.0.1", port)
        result = torchtop(
            "run", "--headless", "--metrics", f"127.0.0.1:{port}", str(SCRIPTS / "train_mlp.py")
        )
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "pick another port" in result.stderr
    assert "training done" not in result.stderr  # the job never started


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("9481", ("127.0.0.1", 9481)),
        ("0", ("127.0.0.1", 0)),
        ("0.0.0.0:9481", ("0.0.0.0", 9481)),
        ("[::1]:0", ("::1", 0)),
    ],
)
def test_metrics_addresses(text: str, address: tuple[str, int]) -> None:
    assert parse_address(text) == address


@pytest.mark.parametrize("text", ["", ":9481", "host:port", "70000"])
def test_bad_metrics_addresses_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_address(text)


# -- the job set ----------------------------------------------------------------------------------


def test_the_job_set_serves_only_the_run_asked_for() -> None:
    class Feed:
        closed = False

        def close(self) -> None:
            self.closed = True

    jobs = JobSet(run="job-42")
    feeds: dict[str, Any] = {}
    for address, rank in (("a", 0), ("b", None)):
        feeds[address] = Feed()
        jobs.add(AgentInfo(1, [], T0, address), feeds[address])  # type: ignore[arg-type]
        jobs.apply(address, hello(rank))
    assert [s.labels.rank for s in jobs.figures()] == [0]
    assert feeds["b"].closed and not feeds["a"].closed


# -- OpenTelemetry --------------------------------------------------------------------------------


def otel_points(reader: Any) -> dict[tuple[str, frozenset[tuple[str, Any]]], tuple[float, str]]:
    """Every data point the SDK collected: (instrument, attributes) -> (value, unit)."""
    out = {}
    data = reader.get_metrics_data()
    for resource_metrics in data.resource_metrics:
        for scope in resource_metrics.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    key = (metric.name, frozenset(point.attributes.items()))
                    out[key] = (point.value, metric.unit)
    return out


def test_otlp_carries_the_same_figures_as_prometheus() -> None:
    pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from torchtop.export.otlp import instrument

    snap = figures_of(model_of(job_messages()))
    assert snap is not None
    reader = InMemoryMetricReader()
    provider = instrument(lambda: [snap], reader)
    try:
        got = otel_points(reader)
    finally:
        provider.shutdown()
    job = frozenset({"run": "job-42", "rank": "3", "local_rank": "3", "hostname": "node7"}.items())
    gpu0 = job | {("device", "cuda:0"), ("UUID", UUID0)}
    assert got[("torchtop_steps", job)] == (20, "{step}")
    assert got[("torchtop_step_duration", job)] == (pytest.approx(2.0), "s")
    assert got[("torchtop_steps_timed", job)] == (19, "{step}")
    assert got[("torchtop_dataloader_wait", job)] == (pytest.approx(0.38), "s")
    assert got[("torchtop_cuda_memory_allocated", gpu0)] == (200 * MIB, "By")
    assert got[("torchtop_cuda_alloc_retries", gpu0)] == (2, "{retry}")
    assert got[("torchtop_ooms", gpu0)] == (1, "{oom}")
    # Every Prometheus series has its OTLP point (the summary as two counters).
    prometheus_series = {
        (name, lbl) for name, lbl in values(exposition([snap])) if not name.endswith("_created")
    }
    assert len(got) == len(prometheus_series)


@pytest.mark.slow
def test_export_of_one_pid_serves_that_job_and_ends_with_it(tmp_path: Any) -> None:
    job = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "train_metrics.py"), "--start", "--steps", "20"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while find_agent(job.pid) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        exporter = subprocess.Popen(
            [sys.executable, "-m", "torchtop", "export", str(job.pid), "--metrics", "127.0.0.1:0"],
            stderr=subprocess.PIPE,
            text=True,
        )
        assert exporter.stderr is not None
        line = exporter.stderr.readline()
        assert "serving metrics on http://127.0.0.1:" in line
        url = line.split()[-1]
        body = ""
        while f'run="{job.pid}"' not in body and time.monotonic() < deadline:
            body = fetch(url)[2]
            time.sleep(0.2)
        assert f'run="{job.pid}"' in body
        assert job.wait(120) == 0
        assert exporter.wait(60) == 0  # it ended with the job
    finally:
        job.kill()
        job.wait()


def test_each_finding_that_holds_is_a_series_until_it_clears() -> None:
    from test_advice import input_job

    model = model_of([hello(3), *input_job(0.5, 10, T0)])
    snap = figures_of(model)
    assert snap is not None and snap.findings == (("input-bound", "critical"),)
    got = values(exposition([snap]))
    finding = labels(finding="input-bound", severity="critical")
    assert got[("torchtop_advice_finding", finding)] == 1
    assert [n for n, _ in got].count("torchtop_advice_finding") == 1

    model.apply_all(input_job(0.0, 15, T0 + 10))  # the waits stop: the finding clears
    cleared = figures_of(model)
    assert cleared is not None and cleared.findings == ()
    assert "torchtop_advice_finding" not in {n for n, _ in values(exposition([cleared]))}


def test_peers_that_trickle_bytes_cannot_hold_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchtop.export.prometheus as prometheus

    monkeypatch.setattr(prometheus, "CONNECTION_DEADLINE_S", 1.0)
    snap = figures_of(model_of(job_messages()))
    assert snap is not None
    srv = MetricsServer(registry_for(lambda: [snap]), max_connections=4).start()
    stop = threading.Event()
    peers: list[socket.socket] = []

    def trickle() -> None:
        # Four peers, each a header byte every 0.5 s (within the read timeout), and new ones in
        # their place when the server closes them: every slot is always asked for.
        while not stop.is_set():
            while len(peers) < 4:
                s = socket.create_connection(("127.0.0.1", srv.port))
                s.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
                peers.append(s)
            for s in list(peers):
                try:
                    s.send(b"a")
                except OSError:
                    peers.remove(s)
                    s.close()
            stop.wait(0.5)

    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    try:
        time.sleep(0.5)
        answered = False
        deadline = time.monotonic() + 30
        while not answered and time.monotonic() < deadline:
            try:
                answered = fetch(srv.url)[0] == 200
            except OSError:  # closed unanswered: every slot was held at that moment
                time.sleep(0.05)
        assert answered, "four trickling peers kept a scrape out for 30 s"
    finally:
        stop.set()
        trickler.join()
        for s in peers:
            s.close()
        srv.close()


def test_a_job_that_only_launched_its_ranks_is_not_exported_as_a_job() -> None:
    """mp.spawn's parent has an agent of its own (torchtop run started it) and waits: its
    ranks are the run's figures, and the parent is their launcher, not a job of 0 steps. A
    single process that launched nothing is exported as before."""
    code = (
        "import subprocess, sys, time\n"
        "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])"
        " for _ in range(2)]\n"
        "print(' '.join(str(k.pid) for k in kids), flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    loner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert parent.stdout is not None
        kids = [int(pid) for pid in parent.stdout.readline().split()]
        jobs = JobSet()
        roles = [(parent.pid, None), (loner.pid, None), (kids[0], 0), (kids[1], 1)]
        for pid, rank in roles:
            jobs.add(AgentInfo(pid, [], T0, f"a{pid}"), None)  # type: ignore[arg-type]
            jobs.apply(f"a{pid}", hello(rank, pid=pid))
        exported = {(s.labels.pid, s.labels.rank) for s in jobs.figures()}
        assert exported == {(loner.pid, None), (kids[0], 0), (kids[1], 1)}
    finally:
        for process in (parent, loner):
            process.kill()
            process.wait()
        for pid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_an_exported_jobs_model_stays_small_over_a_long_run() -> None:
    """A node's exporter may follow a thousand ranks: each rank's model keeps the latest readings
    and the rules' recent steps, not the viewer's long step history; the exported figures are
    the same."""

    def long_run() -> list[Message]:
        out: list[Message] = [hello(3)]
        for frame in range(1600):  # 16,000 steps of 50 ms, 10 a frame
            t = T0 + 0.5 * (frame + 1)
            ends = [t - 0.05 * (9 - i) for i in range(10)]
            out.append(
                dataclasses.replace(
                    steps(t, 10 * (frame + 1), 10, 0.5, 0.05),
                    ends=ends,
                    durations=[0.05] * 10,
                    waits=[0.005] * 10,
                    startups=[0.0] * 10,
                    optimizer=[0.01] * 10,
                    batch_samples=[32] * 10,
                )
            )
        return out

    messages = long_run()
    sizes = {}
    models = {}
    for name, make in (("viewer", JobModel), ("exporter", _exported_job)):
        tracemalloc.start()
        model = make()
        for message in messages:
            model.apply(message)
        sizes[name] = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        models[name] = model
    assert models["exporter"].training.total == 16_000
    assert sizes["exporter"] < 1 << 20 and sizes["exporter"] * 8 < sizes["viewer"], sizes
    exported = figures_of(models["exporter"])
    assert exported is not None and exported == figures_of(models["viewer"])
