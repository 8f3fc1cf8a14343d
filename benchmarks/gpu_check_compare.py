"""The GPU check's comparisons: pure functions from what was read to a :class:`Check` row.

Each function holds the agent's frames (a recording's JSON lines, as plain dicts, so a field
added or renamed in the protocol is seen rather than rejected) against an independent source of
truth that the job or the machine gave: ``torch.cuda.memory_stats()`` read in the job, the
allocator's own out-of-memory observer, ``nvidia-smi``, the job's own ``torch.profiler``, the
demos' measured results. Nothing here runs anything or imports torch, so the tests run every
comparison on recorded data, on a machine without a GPU.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MIB = 1 << 20
PASS, FAIL, SKIP = "pass", "FAIL", "skip"

Frame = Mapping[str, Any]


@dataclass(frozen=True)
class Check:
    """One row of the table."""

    name: str
    expected: str
    measured: str
    status: str

    @property
    def failed(self) -> bool:
        return self.status == FAIL


def check(name: str, expected: str, measured: str, ok: bool | None) -> Check:
    """``ok`` None: the situation the check needs did not arise (a skip, said why in measured)."""
    return Check(name, expected, measured, SKIP if ok is None else PASS if ok else FAIL)


def mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:.2f} MiB"


def read_frames(text: str) -> list[dict[str, Any]]:
    """A recording's frames as dicts (damaged lines skipped, as the reader does)."""
    frames = []
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("kind"), str):
            frames.append(obj)
    return frames


def of_kind(frames: Iterable[Frame], kind: str) -> list[Frame]:
    return [f for f in frames if f.get("kind") == kind]


# --------------------------------------------------------------------------------------------
# allocator figures against torch.cuda.memory_stats() read in the job
# --------------------------------------------------------------------------------------------

#: MemoryStats field -> the memory_stats() key it must equal.
STAT_KEYS = {
    "allocated_bytes": "allocated_bytes.all.current",
    "reserved_bytes": "reserved_bytes.all.current",
    "active_bytes": "active_bytes.all.current",
    "inactive_split_bytes": "inactive_split_bytes.all.current",
    "peak_allocated_bytes": "allocated_bytes.all.peak",
    "peak_reserved_bytes": "reserved_bytes.all.peak",
    "num_alloc_retries": "num_alloc_retries",
    "num_ooms": "num_ooms",
}
#: Device free memory may move by this much between the job's read and the agent's (a CUDA
#: library's workspace, another process).
FREE_TOLERANCE = 64 * MIB


def allocator_matches_job(
    frames: Sequence[Frame], plateaus: Sequence[Mapping[str, Any]], device: str = "cuda:0"
) -> Check:
    """Every sample taken inside a plateau where the job's own ``memory_stats()`` did not move
    equals it, field by field; total equals and free is within FREE_TOLERANCE of the job's
    ``mem_get_info()``."""
    name = "allocator: samples = memory_stats() in the job"
    expected = "every sample in a still plateau equals the job's memory_stats()"
    stable = [
        p
        for p in plateaus
        if all(p["before"].get(k) == p["after"].get(k) for k in STAT_KEYS.values())
    ]
    compared = 0
    mismatches: list[str] = []
    for p in stable:
        free, total = p.get("mem_get_info", [None, None])
        for frame in of_kind(frames, "sample"):
            if not p["t0"] < frame["t"] < p["t1"]:
                continue
            for mem in frame.get("memory", []):
                if mem.get("device") != device:
                    continue
                compared += 1
                for field, key in STAT_KEYS.items():
                    if mem.get(field) != p["after"].get(key):
                        mismatches.append(f"{field} {mem.get(field)} != {p['after'].get(key)}")
                if total is not None and mem.get("total_bytes") != total:
                    mismatches.append(f"total_bytes {mem.get('total_bytes')} != {total}")
                got_free = mem.get("free_bytes")
                if free is not None and (got_free is None or abs(got_free - free) > FREE_TOLERANCE):
                    mismatches.append(f"free_bytes {mib(got_free)} vs {mib(free)}")
    measured = f"{compared} samples in {len(stable)} still plateaus, {len(mismatches)} differ"
    if mismatches:
        measured += f" ({mismatches[0]})"
    return check(name, expected, measured, compared > 0 and not mismatches)


# --------------------------------------------------------------------------------------------
# NVML against nvidia-smi at the same time
# --------------------------------------------------------------------------------------------

SMI_FIELDS = ("index", "uuid", "memory.used", "memory.total", "memory.reserved", "utilization.gpu")
#: NVML and nvidia-smi reads paired when this close in time (s).
PAIR_WINDOW_S = 0.3
MEMORY_TOLERANCE = 32 * MIB
UTIL_TOLERANCE = 25.0
#: Utilization is averaged over up to a second: readings this close to a plateau's edges are
#: left out.
UTIL_EDGE_S = 1.5


def parse_smi(text: str, fields: Sequence[str] = SMI_FIELDS) -> list[dict[str, Any]]:
    """``nvidia-smi --query-gpu=... --format=csv,noheader,nounits`` rows as dicts (numbers as
    floats, "[N/A]" as None)."""
    rows = []
    for line in text.strip().splitlines():
        values = [v.strip() for v in line.split(",")]
        if len(values) != len(fields):
            continue
        row: dict[str, Any] = {}
        for field, value in zip(fields, values, strict=True):
            if field == "uuid":
                row[field] = value
                continue
            try:
                row[field] = float(value)
            except ValueError:
                row[field] = None
        rows.append(row)
    return rows


def normal_uuid(uuid: str | None) -> str:
    """``GPU-1b2c…`` (NVML, nvidia-smi) and ``1b2c…`` (torch) compare equal."""
    text = (uuid or "").strip().lower()
    return (text[4:] if text.startswith("gpu-") else text).replace("-", "")


def _pairs(
    frames: Sequence[Frame], smi_reads: Sequence[Mapping[str, Any]]
) -> list[tuple[float, Mapping[str, Any], Mapping[str, Any]]]:
    """(time, NVML GpuStats dict, nvidia-smi row) for reads at most PAIR_WINDOW_S apart, GPUs
    matched by UUID where the agent gives one, else by index."""
    gpu_frames = of_kind(frames, "gpu")
    pairs = []
    for read in smi_reads:
        t = read["t"]
        near = min(gpu_frames, key=lambda f: abs(f["t"] - t), default=None)
        if near is None or abs(near["t"] - t) > PAIR_WINDOW_S:
            continue
        for row in read["rows"]:
            for gpu in near.get("gpus", []):
                if gpu.get("uuid"):
                    same = normal_uuid(gpu["uuid"]) == normal_uuid(row.get("uuid"))
                else:
                    same = gpu.get("index") == row.get("index")
                if same:
                    pairs.append((t, gpu, row))
    return pairs


def _inside(t: float, windows: Sequence[Mapping[str, Any]], edge: float, kind: str | None) -> bool:
    return any(
        w["t0"] + edge < t < w["t1"] - min(edge, 0.2) and (kind is None or w["kind"] == kind)
        for w in windows
    )


def nvml_memory_matches_smi(
    frames: Sequence[Frame],
    smi_reads: Sequence[Mapping[str, Any]],
    plateaus: Sequence[Mapping[str, Any]],
) -> Check:
    """NVML's used memory equals nvidia-smi's (MiB) read at the same time in a still plateau.
    nvidia-smi may leave the driver's reserved memory out of "used" where NVML's v1 call counts
    it: either reading matches."""
    name = "nvml: used memory = nvidia-smi"
    expected = f"within {mib(MEMORY_TOLERANCE)} while memory holds still"
    diffs = []
    for t, gpu, row in _pairs(frames, smi_reads):
        used = gpu.get("memory_used_bytes")
        if not _inside(t, plateaus, 0.1, None) or used is None or row.get("memory.used") is None:
            continue
        smi_used = row["memory.used"] * MIB
        candidates = [smi_used]
        if row.get("memory.reserved") is not None:
            candidates.append(smi_used + row["memory.reserved"] * MIB)
        diffs.append(min(abs(used - c) for c in candidates))
    if not diffs:
        return check(name, expected, "no NVML read paired with an nvidia-smi read", False)
    worst = max(diffs)
    return check(
        name, expected, f"{len(diffs)} pairs, largest gap {mib(worst)}", worst <= MEMORY_TOLERANCE
    )


def nvml_utilization_matches_smi(
    frames: Sequence[Frame],
    smi_reads: Sequence[Mapping[str, Any]],
    plateaus: Sequence[Mapping[str, Any]],
) -> Check:
    """NVML's GPU utilization within UTIL_TOLERANCE points of nvidia-smi's, in a busy plateau
    (where nvidia-smi reads 50% or more) and an idle one."""
    name = "nvml: utilization = nvidia-smi"
    expected = f"within {UTIL_TOLERANCE:.0f} points, busy and idle"
    diffs = []
    busy = idle = 0
    for t, gpu, row in _pairs(frames, smi_reads):
        util, smi = gpu.get("util_gpu_percent"), row.get("utilization.gpu")
        if util is None or smi is None:
            continue
        if _inside(t, plateaus, UTIL_EDGE_S, "busy"):
            busy += smi >= 50
        elif _inside(t, plateaus, UTIL_EDGE_S, "idle"):
            idle += 1
        else:
            continue
        diffs.append(abs(util - smi))
    worst = max(diffs, default=None)
    measured = (
        f"{busy} busy and {idle} idle pairs, largest gap "
        f"{'-' if worst is None else f'{worst:.0f}'} points"
    )
    ok = busy > 0 and idle > 0 and worst is not None and worst <= UTIL_TOLERANCE
    return check(name, expected, measured, ok)


def nvml_gpu_matched_by_uuid(
    frames: Sequence[Frame],
    job_uuid: str,
    smi_rows: Sequence[Mapping[str, Any]],
    device: str = "cuda:0",
    job: str = "",
) -> Check:
    """The NVML GPU the job runs on is found by its UUID (torch's
    ``get_device_properties(i).uuid`` = NVML's), listed first, and marked as the job's: its
    ``cuda_device`` is the job's device and ``in_job`` is true; no other GPU claims that
    device."""
    name = "nvml: job's GPU matched by UUID" + (f" ({job})" if job else "")
    expected = f"the job's UUID listed first, as {device}, in_job"
    gpu_frames = of_kind(frames, "gpu")
    if not gpu_frames:
        return check(name, expected, "no NVML frames", False)
    gpus = gpu_frames[-1].get("gpus", [])
    want = normal_uuid(job_uuid)
    smi = [normal_uuid(r.get("uuid")) for r in smi_rows]
    if want not in smi:
        return check(name, expected, f"nvidia-smi does not list the job's UUID {job_uuid}", False)
    uuids = [normal_uuid(g.get("uuid")) for g in gpus]
    if not any(uuids):
        return check(name, expected, "the agent's GPU frames carry no UUID", False)
    if want not in uuids:
        return check(name, expected, f"no NVML GPU has UUID {job_uuid}", False)
    position = uuids.index(want)
    gpu = gpus[position]
    measured = (
        f"position {position}, cuda_device {gpu.get('cuda_device')!r}, in_job {gpu.get('in_job')!r}"
    )
    others = [g for i, g in enumerate(gpus) if i != position]
    ok = (
        position == 0
        and gpu.get("cuda_device") == device
        and gpu.get("in_job") is True
        and not any(g.get("cuda_device") == device for g in others)
    )
    return check(name, expected, measured, ok)


def hello_uuid(
    frames: Sequence[Frame], job_uuid: str, smi_rows: Sequence[Mapping[str, Any]], job: str = ""
) -> Check:
    """The devices the agent describes (the hello's, or any later frame's ``devices``) give
    ``cuda:0`` the UUID torch gives the job's device, which is the one nvidia-smi lists: the
    key that joins CUDA devices to NVML's and DCGM's GPUs."""
    name = "devices: cuda:0 UUID = torch's = nvidia-smi's" + (f" ({job})" if job else "")
    expected = job_uuid or "?"
    uuids = [
        d.get("uuid")
        for f in frames
        for d in f.get("devices") or []
        if isinstance(d, Mapping) and d.get("id") == "cuda:0" and d.get("uuid")
    ]
    if not uuids:
        return check(name, expected, "no frame gives cuda:0 a UUID", False)
    got = str(uuids[-1])
    smi = {normal_uuid(r.get("uuid")) for r in smi_rows}
    ok = normal_uuid(got) == normal_uuid(job_uuid) and normal_uuid(got) in smi
    return check(name, expected, got, ok)


# --------------------------------------------------------------------------------------------
# energy: NVML's counter in the agent's frames against the job's own reads
# --------------------------------------------------------------------------------------------

#: The agent's mean power over a plateau within this share of the job's (or ENERGY_TOLERANCE_W):
#: the agent reads a few times a second inside the plateau, the job at its edges.
ENERGY_TOLERANCE = 0.25
ENERGY_TOLERANCE_W = 30.0


def job_gpu_energy(frames: Sequence[Frame], device: str = "cuda:0") -> list[tuple[float, int]]:
    """``(t, mJ)`` of the job's GPU (the NVML GPU marked as ``device``) in the agent's frames."""
    readings = []
    for f in of_kind(frames, "gpu"):
        for gpu in f.get("gpus", []):
            if gpu.get("cuda_device") == device and gpu.get("energy_mj") is not None:
                readings.append((float(f["t"]), int(gpu["energy_mj"])))
    return readings


def nvml_energy_matches_job(
    frames: Sequence[Frame], plateaus: Sequence[Mapping[str, Any]]
) -> Check:
    """The agent's mean power over each plateau, from NVML's energy counter in its frames,
    within ENERGY_TOLERANCE of the job's own counter read at the plateau's edges; a busy
    plateau and an idle one compared, the busy one drawing more."""
    name = "nvml: energy counter = the job's own read"
    expected = (
        f"mean power within {ENERGY_TOLERANCE:.0%} or {ENERGY_TOLERANCE_W:.0f} W, busy > idle"
    )
    readings = job_gpu_energy(frames)
    if not readings:
        return check(name, expected, "no energy counter for cuda:0 in the agent's frames", False)
    compared: dict[str, list[tuple[float, float]]] = {}
    worst = 0.0
    for p in plateaus:
        job_mj = p.get("energy_mj") or [None, None]
        if job_mj[0] is None or job_mj[1] is None:
            continue
        inside = [r for r in readings if p["t0"] < r[0] < p["t1"]]
        if len(inside) < 2 or inside[-1][0] - inside[0][0] <= 0:
            continue
        job_w = (job_mj[1] - job_mj[0]) / 1000 / (p["t1"] - p["t0"])
        agent_w = (inside[-1][1] - inside[0][1]) / 1000 / (inside[-1][0] - inside[0][0])
        compared.setdefault(p["kind"], []).append((job_w, agent_w))
        gap = abs(agent_w - job_w)
        if gap > max(ENERGY_TOLERANCE * job_w, ENERGY_TOLERANCE_W):
            worst = max(worst, gap)
    if not compared:
        return check(name, expected, "the job could not read its energy counter", None)
    mean = {k: statistics.mean(a for _, a in v) for k, v in compared.items()}
    measured = ", ".join(
        f"{kind} {statistics.mean(j for j, _ in v):.0f} W (job) / {mean[kind]:.0f} W (agent)"
        for kind, v in compared.items()
    )
    ok = "busy" in mean and "idle" in mean and mean["busy"] > mean["idle"] and worst == 0.0
    return check(name, expected, measured, ok)


def energy_per_step_matches_counter(
    frames: Sequence[Frame], report_energy: Mapping[str, Any] | None
) -> Check:
    """The report's joules per step for cuda:0 equals the counter's difference from the
    agent's first reading to its last over the steps that ended between them, counted from the
    ``steps`` frames' ends here."""
    name = "energy: J/step = counter difference over the steps"
    readings = job_gpu_energy(frames)
    if len(readings) < 2:
        return check(name, "two readings or more", f"{len(readings)} readings", False)
    (t0, e0), (t1, e1) = readings[0], readings[-1]
    ends = [e for f in of_kind(frames, "steps") for e in f.get("ends", [])]
    if sum(int(f.get("count", 0)) for f in of_kind(frames, "steps")) != len(ends):
        return check(name, "every step listed", "the agent sampled the steps", None)
    steps = sum(1 for e in ends if t0 < e <= t1)
    if not steps:
        return check(name, "steps between readings", "none", False)
    expected = (e1 - e0) / 1000 / steps
    entry = (report_energy or {}).get("cuda:0") or {}
    got = entry.get("joules_per_step")
    measured = f"{'-' if got is None else f'{got:.4f}'} J/step over {entry.get('steps')} steps"
    ok = got is not None and entry.get("steps") == steps and abs(got - expected) <= 1e-4
    return check(name, f"{expected:.4f} J/step over {steps} steps", measured, ok)


# --------------------------------------------------------------------------------------------
# the devices a view shows
# --------------------------------------------------------------------------------------------


def shown_devices_match(shown: Sequence[str] | None, expected: Sequence[str], job: str) -> Check:
    """The memory view shows the devices the job uses (allocated or reserved
    > 0, or its current device), not the first device the hello lists. For a CUDA job
    (``expected`` names CUDA devices) the CUDA devices shown are those; the host's memory may
    be shown beside them."""
    name = f"view: devices shown ({job})"
    if shown is None:
        return check(name, ", ".join(expected), "the model gave no list of devices", False)
    cuda = any(d.startswith("cuda") for d in expected)
    compared = [d for d in shown if d.startswith("cuda")] if cuda else list(shown)
    return check(name, ", ".join(expected), ", ".join(shown) or "none", compared == list(expected))


# --------------------------------------------------------------------------------------------
# out of memory
# --------------------------------------------------------------------------------------------


def _stat(stats: Mapping[str, Any], key: str) -> int | None:
    value = stats.get(key)
    return value if isinstance(value, int) else None


def expected_free(observer: Mapping[str, Any]) -> int:
    """What free means under ``set_per_process_memory_fraction``: the
    device's free memory, but no more than the cap (the observer's total) less reserved."""
    reserved = _stat(observer["memory_stats"], "reserved_bytes.all.current") or 0
    return min(int(observer["device_free"]), int(observer["device_total"]) - reserved)


def oom_event_checks(
    label: str,
    events: Sequence[Frame],
    truth: Mapping[str, Any],
    *,
    fragmented: bool,
    top_site: tuple[str, int],
) -> list[Check]:
    """The ``oom`` event against the allocator's own numbers at the failure (the job's observer:
    its arguments, ``memory_stats()`` and the snapshot's ``oom`` trace entry), the verdict and
    the top site's file:line."""
    rows: list[Check] = []
    observers = truth.get("observer") or []
    oom = [e for e in events if e.get("kind") == "oom"]
    if not observers or not oom:
        what = "no observer call in the job" if not observers else "no oom event recorded"
        return [check(f"oom {label}: event", "one oom event", what, False)]
    obs, event = observers[0], oom[0]
    stats = obs["memory_stats"]
    requested = int(truth["requested"])
    want = {
        "requested": requested,
        "reserved": _stat(stats, "reserved_bytes.all.current"),
        "allocated": _stat(stats, "allocated_bytes.all.current"),
    }
    got = {k: event.get(f"{k}_bytes") for k in want}
    differ = [f"{k} {mib(got[k])} != {mib(v)}" for k, v in want.items() if got[k] != v]
    trace_size = obs.get("trace_oom_size")
    if trace_size is not None and trace_size != requested:
        differ.append(f"the snapshot's oom entry asked {mib(trace_size)}")
    rows.append(
        check(
            f"oom {label}: requested/reserved/allocated",
            f"{mib(requested)} / {mib(want['reserved'])} / {mib(want['allocated'])}",
            "; ".join(differ)
            or f"{mib(got['requested'])} / {mib(got['reserved'])} / {mib(got['allocated'])}",
            not differ,
        )
    )
    segment = int(obs["alloc"])
    rows.append(
        check(
            f"oom {label}: request, not segment",
            f"{mib(requested)} (segment {mib(segment)})",
            mib(got["requested"]),
            got["requested"] == requested,
        )
    )
    free = expected_free(obs)
    got_free = event.get("free_bytes")
    rows.append(
        check(
            f"oom {label}: free = min(device, cap - reserved)",
            mib(free),
            mib(got_free),
            got_free is not None and abs(int(got_free) - free) <= 1 * MIB,
        )
    )
    verdict = "fragmented" if fragmented else "full"
    got_verdict = event.get("verdict") or (
        None
        if event.get("fragmented") is None
        else ("fragmented" if event["fragmented"] else "full")
    )
    got_word = "fragmented" if event.get("fragmented") else "full"
    rows.append(
        check(
            f"oom {label}: verdict",
            verdict,
            f"{got_word}: {str(got_verdict)[:60]}",
            event.get("fragmented") is fragmented,
        )
    )
    sites = event.get("top_sites") or []
    file, line = top_site
    got_site = f"{sites[0]['file'].rsplit('/', 1)[-1]}:{sites[0]['line']}" if sites else "none"
    rows.append(
        check(f"oom {label}: top site", f"{file}:{line}", got_site, got_site == f"{file}:{line}")
    )
    return rows


def marker_line(source: str, marker: str) -> int:
    """The 1-based line of ``source`` that carries ``# gpu_check: marker``."""
    for number, text in enumerate(source.splitlines(), 1):
        if text.rstrip().endswith(f"# gpu_check: {marker}"):
            return number
    raise ValueError(f"no line marked {marker!r}")


def snapshot_loads(path: str | None, mode: int | None, rc: int | None, output: str) -> Check:
    """The snapshot file exists, is 0600, and ``python -m torch.cuda._memory_viz stats`` reads
    it."""
    name = "oom: snapshot opens in _memory_viz"
    expected = "a 0600 pickle; _memory_viz stats exits 0"
    if not path:
        return check(name, expected, "no snapshot_path in the event", False)
    measured = f"mode {'-' if mode is None else oct(mode)}, _memory_viz exit {rc}"
    if rc:
        measured += f": {output.strip().splitlines()[-1][:60] if output.strip() else ''}"
    return check(name, expected, measured, mode == 0o600 and rc == 0 and bool(output.strip()))


_FRAME_LINE = re.compile(r'^\s*File "([^"]+)", line (\d+), in (.+)$')
_TRIED = re.compile(r"Tried to allocate ([\d.]+ \w+)")


def job_error(stderr: str) -> tuple[list[str], str, str]:
    """The last traceback in ``stderr``: its frames (file name:line in function), the
    exception's type, and the size it says it tried to allocate."""
    lines = stderr.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    if not starts:
        return [], "", ""
    frames: list[str] = []
    exc_type = tried = ""
    for line in lines[starts[-1] + 1 :]:
        match = _FRAME_LINE.match(line)
        if match:
            file, number, function = match.groups()
            frames.append(f"{file.rsplit('/', 1)[-1]}:{number} in {function}")
            continue
        if line and not line.startswith(" "):
            exc_type = line.split(":", 1)[0]
            found = _TRIED.search(line)
            tried = found.group(1) if found else ""
            break
    return frames, exc_type, tried


def _job_frames(frames: list[str]) -> list[str]:
    """The job's own frames: under torchtop the runner's frames come first."""
    for i, frame in enumerate(frames):
        if frame.startswith("gpu_check_jobs.py:"):
            return frames[i:]
    return frames


def job_error_unchanged(
    label: str, plain: tuple[int | None, str], watched: tuple[int | None, str]
) -> Check:
    """Under torchtop the job ends with the same exit code, exception and traceback (its own
    frames) as without."""
    (rc_plain, err_plain), (rc_run, err_run) = plain, watched
    a, b = job_error(err_plain), job_error(err_run)
    a_frames, b_frames = _job_frames(a[0]), _job_frames(b[0])
    expected = f"exit {rc_plain}, {a[1] or 'no exception'} ({a[2] or '?'}), {len(a_frames)} frames"
    measured = f"exit {rc_run}, {b[1] or 'no exception'} ({b[2] or '?'}), {len(b_frames)} frames"
    ok = (
        rc_plain == rc_run
        and rc_plain not in (0, None)
        and a[1] == b[1] == "torch.OutOfMemoryError"
        and a[2] == b[2]
        and a_frames == b_frames
    )
    return check(f"oom: job's error unchanged ({label})", expected, measured, ok)


def pause_timed_out(frames: Sequence[Frame], timeout_s: float) -> Check:
    """``--pause-on-oom --pause-timeout S``: the event says paused, and the job resumes by the
    timeout, S seconds after the failure."""
    name = "oom: --pause-on-oom resumes at --pause-timeout"
    expected = f"paused, resumed by timeout after {timeout_s:.1f} s"
    oom = of_kind(frames, "oom")
    resumed = of_kind(frames, "oom_resumed")
    if not oom:
        return check(name, expected, "no oom event", False)
    if not resumed:
        return check(name, expected, f"paused={oom[0].get('paused')}, never resumed", False)
    gap = resumed[0]["t"] - oom[0]["t"]
    reason = str(resumed[0].get("reason", ""))
    measured = f"paused={oom[0].get('paused')}, resumed ({reason}) after {gap:.1f} s"
    ok = (
        bool(oom[0].get("paused"))
        and "timeout" in reason
        and timeout_s - 0.5 <= gap <= timeout_s + 5
    )
    return check(name, expected, measured, ok)


def handled_ooms_not_published(
    frames: Sequence[Frame], trials: Sequence[Mapping[str, Any]]
) -> Check:
    """An OOM torch catches itself (the allocator counted it, no error reached
    the job) publishes no ``oom`` event; one that reached the job does."""
    name = "oom: handled inside torch not published"
    expected = "handled OOMs counted apart, not published; one event per OOM the job saw"
    events = of_kind(frames, "oom")

    def published(trial: Mapping[str, Any]) -> int:
        return sum(1 for e in events if trial["t0"] - 0.05 <= e["t"] <= trial["t1"] + 0.05)

    handled = [t for t in trials if t["ooms"] > 0 and not t["raised"]]
    raised = [t for t in trials if t["raised"]]
    if not handled:
        # The job is built to provoke one: without it nothing here was proven.
        return check(
            name, expected, f"no OOM was handled inside torch ({len(trials)} trials)", False
        )
    wrong = sum(published(t) for t in handled)
    missing = sum(1 for t in raised if published(t) == 0)
    counted = [
        m.get("handled_ooms")
        for f in of_kind(frames, "sample")
        for m in f.get("memory", [])
        if m.get("handled_ooms") is not None
    ]
    measured = (
        f"{len(handled)} handled: {wrong} published, counted {max(counted, default=None)}; "
        f"{len(raised)} seen by the job: {len(raised) - missing} published"
    )
    ok = wrong == 0 and missing == 0 and max(counted, default=0) > 0
    return check(name, expected, measured, ok)


def _handled_counted(frames: Sequence[Frame]) -> int:
    """The most failures the agent's samples counted as handled inside torch."""
    return max(
        (
            int(m["handled_ooms"])
            for f in of_kind(frames, "sample")
            for m in f.get("memory", [])
            if isinstance(m.get("handled_ooms"), int)
        ),
        default=0,
    )


def published_with_second_observer(frames: Sequence[Frame], truth: Mapping[str, Any]) -> Check:
    """The job attached its own OOM observer after the agent's (as PyTorch's docs suggest, to
    dump a snapshot): the allocator calls both, then throws. The failure that reached the job
    is still published, and not counted as handled."""
    name = "oom: published with the job's own observer"
    expected = "the job's observer ran; one oom event; 0 counted handled"
    calls = len(truth.get("observer") or [])
    events = len(of_kind(frames, "oom"))
    handled = _handled_counted(frames)
    measured = f"job's observer {calls} calls; {events} oom events; {handled} counted handled"
    if calls == 0:
        return check(name, expected, measured + " (no second observer ran)", False)
    return check(name, expected, measured, events >= 1 and handled == 0)


def backward_oom(frames: Sequence[Frame], truth: Mapping[str, Any]) -> Check:
    """An OOM in backward: the allocator fails in the autograd engine's device thread (no
    Python frames there), the error reaches the job at ``loss.backward()``. The agent
    publishes it, marked as in backward, with the request the snapshot's ``oom`` entry holds."""
    name = "oom: in backward (autograd's thread)"
    calls = truth.get("observer") or []
    requested = calls[0].get("trace_oom_size") if calls else None
    expected = f"published, in_backward, {mib(requested)}"
    if not calls or not truth.get("raised"):
        return check(name, expected, "the job saw no OOM in backward", False)
    if calls[0].get("main_thread"):
        return check(name, expected, "the OOM came in the main thread, not the engine's", None)
    oom = of_kind(frames, "oom")
    if not oom:
        return check(name, expected, "no oom event", False)
    event = oom[0]
    measured = f"in_backward {event.get('in_backward')}, {mib(event.get('requested_bytes'))}"
    ok = event.get("in_backward") is True and event.get("requested_bytes") == requested
    return check(name, expected, measured, ok)


def holders_at_backward_oom(frames: Sequence[Frame], truth: Mapping[str, Any]) -> Check:
    """At an OOM in backward the agent reads what holds the memory in the autograd engine's
    thread (safe there: the stepping thread waits for the backward): the event's split gives
    the job's parameters, gradients and momentum, each to its blocks (at most 2 MiB more per
    category, for blocks the allocator did not split)."""
    name = "oom: what holds it, read in autograd's thread"
    names = ("parameters", "gradients", "optimizer_state")
    expected = ", ".join(f"{n} {mib(truth.get(n))}" for n in names)
    if not truth.get("raised"):
        return check(name, expected, "the job saw no OOM in backward", False)
    oom = of_kind(frames, "oom")
    if not oom:
        return check(name, expected, "no oom event", False)
    split = {c.get("category"): c.get("bytes") for c in oom[0].get("by_category") or []}
    measured = ", ".join(f"{n} {mib(split.get(n))}" for n in names)
    ok = all(
        isinstance(split.get(n), int) and 0 <= split[n] - int(truth[n]) <= 2 * MIB for n in names
    )
    return check(name, expected, measured, ok)


def free_blocks_on_the_failing_stream(frames: Sequence[Frame], truth: Mapping[str, Any]) -> Check:
    """Free blocks on another stream cannot serve the request (the allocator keeps blocks per
    stream): the event's largest free block is the failing stream's, which the job's
    observer read from the snapshot, not the device's largest."""
    name = "oom: free blocks counted on the failing stream"
    calls = truth.get("observer") or []
    if not calls:
        return check(name, "an OOM", "the job saw no OOM", False)
    call = calls[0]
    on_stream, anywhere = call.get("largest_free_block_on_stream"), call.get("largest_free_block")
    expected = f"{mib(on_stream)} (the device's largest: {mib(anywhere)})"
    if on_stream is None or on_stream == anywhere:
        return check(name, expected, "no larger free block on another stream", None)
    oom = of_kind(frames, "oom")
    if not oom:
        return check(name, expected, "no oom event", False)
    got = oom[0].get("largest_free_block_bytes")
    return check(name, expected, mib(got), got == on_stream)


def async_backend(
    rc: int | None, frames: Sequence[Frame], truth: Mapping[str, Any] | None
) -> Check:
    """``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``: the job runs to its end and sees its
    own OOM, and the agent either captures it or says why it cannot (no history, no observer
    on this backend); never silence, never a broken job."""
    name = "oom: cudaMallocAsync backend"
    expected = "the job ends normally; an oom event or the reason there is none"
    if rc != 0 or truth is None:
        return check(name, expected, f"the job failed (exit {rc})", False)
    if not truth.get("message"):
        return check(name, expected, "the job saw no OOM", False)
    events = of_kind(frames, "oom")
    reasons = [
        str(f.get("detail") or "")
        for f in of_kind(frames, "probe_status")
        if f.get("probe") == "oom_capture" and not f.get("available", True)
    ]
    if events:
        return check(name, expected, f"{len(events)} oom event(s)", True)
    if reasons:
        return check(name, expected, f"no event: {reasons[0][:80]}", True)
    return check(name, expected, "no oom event and no reason given", False)


def never_initialised_cuda(
    frames: Sequence[Frame], truth: Mapping[str, Any], seconds: float
) -> Check:
    """A CPU job on a CUDA build, long enough for op windows to come due: the agent never
    initialized CUDA in it (``libcuda.so`` is not mapped, ``torch.cuda.is_initialized()`` is
    false at the end), and the ops panel says why there are no windows, or there are windows
    that did not need CUDA."""
    name = "agent: never initializes CUDA in a CPU job"
    expected = f"ran >= {seconds:.0f} s; libcuda.so not mapped; ops windows or the reason"
    ran = float(truth.get("seconds") or 0.0)
    mapped = truth.get("libcuda_mapped")
    initialized = truth.get("cuda_initialized")
    windows = len(of_kind(frames, "ops"))
    waiting = [
        str(f.get("detail") or "")
        for f in of_kind(frames, "probe_status")
        if f.get("probe") == "ops"
        and not f.get("available", True)
        and "CUDA" in str(f.get("detail"))
    ]
    measured = (
        f"ran {ran:.1f} s; libcuda.so {'mapped' if mapped else 'not mapped'}; CUDA "
        f"{'initialized' if initialized else 'not initialized'}; {windows} ops windows"
        + ("; waiting for CUDA" if waiting else "")
    )
    if ran < seconds:
        return check(name, expected, measured + " (too short to prove it)", False)
    ok = mapped is False and initialized is False and (windows > 0 or bool(waiting))
    return check(name, expected, measured, ok)


def free_under_cap_matches(frames: Sequence[Frame], plateau: Mapping[str, Any] | None) -> Check:
    """Under ``set_per_process_memory_fraction``, the memory panel's free figure is what the
    job can still allocate: held against the largest allocation the job then really got
    (found by trying, to within ``plateau["resolution"]``), while ``mem_get_info()`` in the
    job shows far more free on the device."""
    name = "allocator: free under a memory fraction"
    if plateau is None:
        return check(name, "a plateau under a cap", "the job gave none", False)
    allocatable = int(plateau["allocatable"])
    device_free = int(plateau["mem_get_info"][0])
    tolerance = int(plateau.get("resolution", 2 * MIB)) + 2 * MIB
    expected = f"{mib(allocatable)} +- {mib(tolerance)} (device free {mib(device_free)})"
    if device_free <= allocatable + tolerance:
        return check(name, expected, "the cap did not bind (the device had no more free)", None)
    got = [
        m.get("free_bytes")
        for f in of_kind(frames, "sample")
        if plateau["t0"] < f["t"] < plateau["t1"]
        for m in f.get("memory", [])
        if m.get("device") == plateau.get("device", "cuda:0")
    ]
    if not got:
        return check(name, expected, "no sample inside the plateau", False)
    worst = max(got, key=lambda v: abs((v if v is not None else -1) - allocatable))
    ok = all(v is not None and abs(v - allocatable) <= tolerance for v in got)
    return check(name, expected, f"{len(got)} samples, furthest {mib(worst)}", ok)


# --------------------------------------------------------------------------------------------
# op windows
# --------------------------------------------------------------------------------------------


def window_in(frames: Sequence[Frame], span: Sequence[float]) -> Frame | None:
    """The ``ops`` frame whose window began inside ``span`` (t0, t1)."""
    for frame in of_kind(frames, "ops"):
        if span[0] - 0.05 <= frame.get("began", -1) <= span[1]:
            return frame
    return None


def _is_kernel(op: Mapping[str, Any]) -> bool:
    return (op.get("total_cpu_s") or 0) == 0 and (op.get("self_device_s") or 0) > 0


def kernels_attributed(window: Frame | None, key_averages: Sequence[Mapping[str, Any]]) -> Check:
    """A known model's kernels: their device time is all counted to the ops that launched them
    (kernels' time = launching ops' self device time, within 5%), and the op with the most
    device time is the one torch.profiler's own ``key_averages`` puts first among ops."""
    name = "ops: kernels attributed to launching ops"
    if window is None:
        return check(name, "an ops window", "no ops window recorded", False)
    ops = window.get("ops") or []
    kernels = sum(op.get("self_device_s") or 0 for op in ops if _is_kernel(op))
    attributed = sum(op.get("self_device_s") or 0 for op in ops if not _is_kernel(op))
    launching = sorted(
        (op for op in ops if not _is_kernel(op) and (op.get("self_device_s") or 0) > 0),
        key=lambda op: -(op.get("self_device_s") or 0),
    )
    truth = sorted(
        (a for a in key_averages if a["name"].startswith("aten::") and a["self_device_us"] > 0),
        key=lambda a: -a["self_device_us"],
    )
    top = launching[0]["name"] if launching else "none"
    truth_top = [a["name"] for a in truth[:3]]
    ratio = attributed / kernels if kernels else 0.0
    expected = f"ratio 0.95-1.05; top op among {', '.join(truth_top) or '?'}"
    measured = f"ratio {ratio:.3f}; top op {top}"
    ok = kernels > 0 and 0.95 <= ratio <= 1.05 and top in truth_top
    return check(name, expected, measured, ok)


def per_step(window: Frame | None, field: str, expected: float, label: str) -> Check:
    """``sync_points`` or ``copies`` per profiled step of one window."""
    name = f"ops: {label}"
    if window is None:
        return check(name, f"{expected:.1f}/step", "no ops window recorded", False)
    steps = window.get("steps") or 0
    value = (window.get(field) or 0) / steps if steps else None
    measured = "no steps" if value is None else f"{value:.2f}/step ({steps} steps)"
    return check(name, f"{expected:.1f}/step", measured, value == expected)


def queued_kernels_counted(window: Frame | None, kernel_s: float | None) -> Check:
    """A window that closes while a long kernel still runs (launched, not waited for): the
    kernel's device time, which CUDA events in the job measured, is in the window."""
    name = "ops: kernels queued at the close counted"
    expected = f">= 90% of {'-' if kernel_s is None else f'{kernel_s * 1000:.0f} ms'}"
    if window is None:
        return check(name, expected, "no ops window recorded", False)
    if not kernel_s:
        return check(name, expected, "the job measured no kernel time", False)
    ops = window.get("ops") or []
    counted = sum(op.get("self_device_s") or 0 for op in ops if _is_kernel(op))
    measured = f"{counted * 1000:.0f} ms of kernels in the window"
    return check(name, expected, measured, counted >= 0.9 * kernel_s)


def copies_kinds(pinned: Frame | None, pageable: Frame | None) -> Check:
    """Pinned and pageable host-to-device copies are told apart by the device activity's name
    (``Memcpy HtoD (Pinned -> Device)`` against ``(Pageable -> Device)``)."""
    name = "ops: pinned vs pageable copies"
    expected = "Pinned -> Device in one, Pageable -> Device in the other"

    def kinds(window: Frame | None) -> set[str]:
        found = set()
        for op in (window or {}).get("ops") or []:
            text = str(op.get("name", ""))
            if text.startswith("Memcpy HtoD"):
                found.add(
                    "pinned" if "Pinned" in text else "pageable" if "Pageable" in text else "?"
                )
        return found

    a, b = kinds(pinned), kinds(pageable)
    measured = f"pinned window: {sorted(a) or 'none'}; pageable window: {sorted(b) or 'none'}"
    return check(name, expected, measured, a == {"pinned"} and b == {"pageable"})


# --------------------------------------------------------------------------------------------
# demos: each one's direction
# --------------------------------------------------------------------------------------------

Results = dict[str, dict[str, Any]]
RESULT_PREFIX = "TORCHTOP_DEMO_RESULT "


def demo_results(output: str) -> Results | None:
    lines = [line for line in output.splitlines() if line.startswith(RESULT_PREFIX)]
    if len(lines) != 1:
        return None
    payload = json.loads(lines[0][len(RESULT_PREFIX) :])
    return {entry["name"]: entry for entry in payload["results"]}


def _peak(r: Results, name: str) -> float:
    return float(r[name]["peak_bytes"])


def _sec(r: Results, name: str) -> float:
    return float(r[name]["seconds"])


def _x(r: Results, name: str, key: str) -> Any:
    return r[name]["extra"][key]


def _ending(r: Results, suffix: str) -> str:
    return next(name for name in r if name.endswith(suffix))


#: demo -> what it must show on a GPU, as (claim, test of the results).
DIRECTIONS: dict[str, list[tuple[str, Callable[[Results], bool]]]] = {
    "tensors": [
        (
            "view allocates ~0",
            lambda r: (
                _peak(r, "view (no copy)") <= _peak(r, "permute().contiguous() (copy)") // 100
            ),
        ),
        (
            "index > slice",
            lambda r: (
                _peak(r, "index [:, :, evens] (copy)") > _peak(r, "slice [:, :, ::2] (no copy)")
            ),
        ),
    ],
    "broadcasting": [
        ("broadcast < repeat", lambda r: _peak(r, "broadcasting") < _peak(r, "repeat")),
        (
            "broadcast < expand",
            lambda r: _peak(r, "broadcasting") < _peak(r, "expand().contiguous()"),
        ),
    ],
    "vectorization": [
        (
            "vectorized < loop",
            lambda r: _sec(r, "vectorized (A * x).sum(1)") < _sec(r, "Python loop over rows"),
        ),
        ("matmul < loop", lambda r: _sec(r, "torch.matmul") < _sec(r, "Python loop over rows")),
    ],
    "inplace": [
        (
            "in place < out of place",
            lambda r: (
                _peak(r, "avg.mul_(0.9).add_(new, alpha=0.1)")
                < _peak(r, "avg = avg * 0.9 + new * 0.1")
            ),
        ),
        (
            "mul_ breaks backward",
            lambda r: _x(r, "sigmoid().mul_(2), backward", "backward") == "RuntimeError",
        ),
    ],
    "autograd": [
        ("no_grad < grad", lambda r: _peak(r, "no_grad()") < _peak(r, "grad on")),
        ("inference_mode < grad", lambda r: _peak(r, "inference_mode()") < _peak(r, "grad on")),
    ],
    "memory": [
        ("del < kept", lambda r: _peak(r, "del as you go") < _peak(r, "intermediates kept")),
        (
            "loss leaks, item() not",
            lambda r: (
                _x(r, "total_loss += loss.item()", "per step") * 10
                < _x(r, "total_loss += loss", "per step")
            ),
        ),
    ],
    "holders": [
        (
            "Adam's state = 2x params",
            lambda r: (
                _x(r, "Adam", "optimizer") >= 2 * _x(r, "Adam", "params")
                and _x(r, "SGD", "optimizer") == 0
            ),
        ),
        (
            "checkpoints < none",
            lambda r: _peak(r, _ending(r, " checkpoints")) < _peak(r, "Adam"),
        ),
    ],
    "checkpointing": [
        (
            "every block < none",
            lambda r: _peak(r, "checkpoint every block") < _peak(r, "no checkpointing"),
        ),
        (
            "segments < none",
            lambda r: _peak(r, _ending(r, " segments")) < _peak(r, "no checkpointing"),
        ),
    ],
    "mixed-precision": [
        ("autocast < float32", lambda r: _peak(r, _ending(r, " autocast")) < _peak(r, "float32")),
        (
            "activations smaller",
            lambda r: (
                _x(r, _ending(r, " autocast"), "activations") < _x(r, "float32", "activations")
            ),
        ),
    ],
    "device": [
        (
            "copies every step > once",
            lambda r: _x(r, "to() every step", "copies") >= 2 and _x(r, "to() once", "copies") == 0,
        ),
        ("once < every step", lambda r: _sec(r, "to() once") < _sec(r, "to() every step")),
        (
            "pinned < pageable",
            lambda r: _sec(r, "pinned, non_blocking") < _sec(r, "pageable .to(cuda)"),
        ),
    ],
    "dataloader": [
        (
            "2 workers wait less",
            lambda r: _x(r, "2 workers", "wait %") < _x(r, "0 workers", "wait %"),
        ),
        (
            "persistent wait less",
            lambda r: _x(r, "2, persistent", "wait %") < _x(r, "0 workers", "wait %"),
        ),
    ],
    "profiling": [
        ("profiler slower", lambda r: _sec(r, "torch.profiler") > _sec(r, "no profiler")),
    ],
    "oom": [
        (
            "the doubled batch failed",
            lambda r: any(e["extra"].get("fits") == "no" for e in r.values()),
        ),
        ("three ways fit", lambda r: sum(e["extra"].get("fits") == "yes" for e in r.values()) >= 4),
    ],
}


def demo_direction(name: str, rc: int | None, output: str) -> Check:
    """``torchtop demo NAME --device cuda --headless --quick``: exit 0, ran on CUDA, and each of
    the demo's claims holds on the measured results."""
    label = f"demo {name}"
    claims = DIRECTIONS.get(name, [])
    expected = "; ".join(c for c, _ in claims) or "exit 0"
    if rc != 0:
        tail = output.strip().splitlines()[-1][:60] if output.strip() else ""
        return check(label, expected, f"exit {rc}: {tail}", False)
    results = demo_results(output)
    if results is None:
        return check(label, expected, "no result line", False)
    failed = []
    for claim, test in claims:
        try:
            ok = test(results)
        except (KeyError, StopIteration, TypeError, ValueError) as exc:
            failed.append(f"{claim}: missing {exc}")
            continue
        if not ok:
            failed.append(claim)
    on_cuda = "device: cpu" not in output
    if not on_cuda:
        failed.append("ran on the CPU")
    return check(
        label, expected, "all hold" if not failed else "not: " + "; ".join(failed), not failed
    )


# --------------------------------------------------------------------------------------------
# cost
# --------------------------------------------------------------------------------------------

#: The agent's cost on a GPU training step, median and mean of the step times (on / off).
MAX_MEDIAN_RATIO = 1.05
MAX_MEAN_RATIO = 1.10
#: The allocator history's cost per allocation (PyTorch documents about 2 µs).
MAX_HISTORY_US = 10.0


def overhead(result: Mapping[str, Any] | None) -> Check:
    name = "cost: agent on/off, GPU step"
    expected = f"median <= {MAX_MEDIAN_RATIO}, mean <= {MAX_MEAN_RATIO}"
    if not result:
        return check(name, expected, "no result", False)
    median, mean = float(result["ratio"]), float(result["mean_ratio"])
    measured = (
        f"median {median:.3f} (pairs {float(result['median_pair_ratio']):.3f}), mean {mean:.3f}; "
        f"{float(result['median_step_off_ms']):.2f} ms off"
    )
    return check(name, expected, measured, median <= MAX_MEDIAN_RATIO and mean <= MAX_MEAN_RATIO)


def history_cost(plain: Sequence[float], history: Sequence[float]) -> Check:
    """Seconds per allocation without and with the allocator history, per process."""
    name = "cost: _record_memory_history per alloc"
    expected = f"<= {MAX_HISTORY_US:.0f} µs more per allocation"
    if not plain or not history:
        return check(name, expected, "no result", False)
    a, b = statistics.median(plain), statistics.median(history)
    extra = (b - a) * 1e6
    measured = f"{a * 1e6:.2f} -> {b * 1e6:.2f} µs ({extra:+.2f} µs, {b / a:.2f}x)"
    return check(name, expected, measured, extra <= MAX_HISTORY_US)


# --------------------------------------------------------------------------------------------
# collectives: the flight recorder's ring as the agent sent it, against the job's own dump
# --------------------------------------------------------------------------------------------


def ring_entries(ring: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The job's own dump read independently of the agent's parser: each collective's group,
    sequence id, op, sizes and times, in record order."""
    out = []
    for entry in sorted(ring.get("entries") or [], key=lambda e: e.get("record_id", 0)):
        if entry.get("is_p2p"):
            continue
        group = entry.get("process_group") or [str(entry.get("pg_id", ""))]
        out.append(
            {
                "pg": str(group[0]),
                "seq": entry.get("collective_seq_id"),
                "op": str(entry.get("profiling_name", "")).rsplit(":", 1)[-1],
                "sizes": entry.get("input_sizes"),
                "enqueued_ns": entry.get("time_created_ns") or 0,
                "started_ns": entry.get("time_discovered_started_ns") or 0,
                "completed_ns": entry.get("time_discovered_completed_ns") or 0,
            }
        )
    return out


def sent_collectives(frames: Iterable[Frame]) -> list[Mapping[str, Any]]:
    """Every collective the agent sent (``collectives`` frames), the latest sending of each
    (pg, seq) kept: an entry is sent again once NCCL marks its completion."""
    latest: dict[tuple[str, int], Mapping[str, Any]] = {}
    for frame in of_kind(frames, "collectives"):
        for entry in frame.get("entries") or []:
            latest[(str(entry.get("pg")), int(entry.get("seq") or 0))] = entry
    return [latest[key] for key in sorted(latest, key=lambda k: (k[0], k[1]))]


def collectives_checks(frames: Sequence[Frame], truth: Mapping[str, Any] | None) -> list[Check]:
    """A single-rank process group's collectives: the agent sent each one the job enqueued, in
    order, with its op and sizes (its ring read live); they equal the job's own dump of the
    ring; and on NCCL each has its start and completion (the common reference across nodes
    that gloo lacks)."""
    names = (
        "collectives: agent read the ring",
        "collectives: equal to the job's dump",
        "collectives: start and completion",
    )
    if not truth:
        return [check(name, "the job's list", "no result from the job", False) for name in names]
    enqueued = list(truth.get("enqueued") or [])
    sent = [e for e in sent_collectives(frames) if str(e.get("pg")) == "0"]
    expected = f"seq 1..{len(enqueued)} on group 0, ops and sizes as enqueued"
    got = [(e.get("seq"), e.get("op"), e.get("sizes")) for e in sent]
    want = [(i + 1, c["op"], c["sizes"]) for i, c in enumerate(enqueued)]
    wrong = sum(a != b for a, b in zip(got, want, strict=False)) + abs(len(got) - len(want))
    rows = [check(names[0], expected, f"{len(got)} sent, {wrong} differ", wrong == 0 and bool(got))]
    own = [e for e in ring_entries(truth.get("ring") or {}) if e["pg"] == "0"]
    keys = ("seq", "op", "sizes", "enqueued_ns")
    differ = sum(
        any(a.get(k) != b.get(k) for k in keys) for a, b in zip(sent, own, strict=False)
    ) + abs(len(sent) - len(own))
    rows.append(
        check(
            names[1],
            f"the same {', '.join(keys)} ({truth.get('dumper')})",
            f"{len(own)} in the job's dump, {differ} differ",
            differ == 0 and bool(own),
        )
    )
    if truth.get("backend") != "nccl":
        rows.append(
            check(names[2], "every entry", f"skipped: {truth.get('backend')} records none", None)
        )
        return rows
    timed = [
        e
        for e in sent
        if 0 < e.get("enqueued_ns", 0) <= e.get("started_ns", 0) <= e.get("completed_ns", 0)
    ]
    completed = sum(1 for e in sent if e.get("completed_ns", 0) > 0)
    rows.append(
        check(
            names[2],
            "every entry: enqueued <= started <= completed (TORCH_NCCL_ENABLE_TIMING=1)",
            f"{len(timed)} of {len(sent)} in order; {completed} with a completion",
            bool(sent) and len(timed) == len(sent),
        )
    )
    return rows


# --------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------


def table(rows: Sequence[Check], width: int = 160) -> str:
    """The rows as a plain-text table: check, expected, measured, status."""
    heads = ("check", "expected", "measured", "result")
    cells = [heads, *((r.name, r.expected, r.measured, r.status) for r in rows)]
    widths = [min(max(len(c[i]) for c in cells), 60) for i in range(4)]

    def line(c: Sequence[str]) -> str:
        text = "  ".join(v[: widths[i]].ljust(widths[i]) for i, v in enumerate(c))
        return text.rstrip()[:width]

    out = [line(heads), "  ".join("-" * w for w in widths)]
    out += [line(c) for c in cells[1:]]
    failed = sum(r.status == FAIL for r in rows)
    skipped = sum(r.status == SKIP for r in rows)
    out.append(f"{len(rows) - failed - skipped} passed, {failed} failed, {skipped} skipped")
    return "\n".join(out)
