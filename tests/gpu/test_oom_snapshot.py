"""Reading CUDA memory snapshots without a GPU: the verdict, the sites, the saved pickle.

The fixtures are ``torch.cuda.memory._snapshot()`` dicts in PyTorch's real format, with the
observer's arguments and ``memory_stats()`` of the same moment (see make_oom_fixtures.py).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from torch.cuda import _memory_viz

import torchtop
from torchtop.agent.memory_snapshot import (
    NO_STACK_FILE,
    bounded,
    is_library_frame,
    save_snapshot,
    site_stack,
    top_sites,
    totals,
    verdict,
)
from torchtop.protocol import MAX_SITES, MAX_STACK_FRAMES

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GiB = 1 << 30
MiB = 1 << 20


def load(name: str) -> dict[str, Any]:
    data = json.loads((FIXTURES / f"cuda_snapshot_{name}.json").read_text())
    for segment in data["snapshot"]["segments"]:
        segment["segment_pool_id"] = tuple(segment["segment_pool_id"])  # a tuple in PyTorch
    return data


@pytest.fixture(params=["fragmented", "full"])
def fixture(request: pytest.FixtureRequest) -> dict[str, Any]:
    return load(request.param)


def test_the_fixtures_are_consistent_with_themselves(fixture: dict[str, Any]) -> None:
    snap, stats = fixture["snapshot"], fixture["memory_stats"]
    sums = totals(snap)
    assert sums.reserved == stats["reserved_bytes.all.current"]
    assert sums.allocated == stats["allocated_bytes.all.current"]
    for segment in snap["segments"]:
        assert segment["total_size"] == sum(b["size"] for b in segment["blocks"])
    assert snap["device_traces"][0][-1]["action"] == "oom"
    assert "addr" not in snap["device_traces"][0][-1]
    assert {b["state"] for s in snap["segments"] for b in s["blocks"]} >= {
        "active_allocated",
        "inactive",
    }


def test_fragmented_verdict() -> None:
    data = load("fragmented")
    observer = data["observer"]
    sums = totals(data["snapshot"], observer["alloc"])
    assert sums.largest_free_block == 1 * GiB + 512 * MiB
    # The small segment's free block cannot serve a 2 GiB request and is not counted.
    assert sums.free_in_segments == 8 * (1 * GiB + 512 * MiB) + 1 * GiB
    assert verdict(observer["alloc"], observer["device_free"], sums) is True


def test_full_verdict() -> None:
    data = load("full")
    observer = data["observer"]
    sums = totals(data["snapshot"], observer["alloc"])
    assert sums.free_in_segments + observer["device_free"] < observer["alloc"]
    assert verdict(observer["alloc"], observer["device_free"], sums) is False


def test_verdict_edges() -> None:
    sums = totals({"segments": []})
    assert verdict(None, 10, sums) is None
    assert verdict(100, 100, sums) is False  # the device alone could hold it: not fragmented
    assert verdict(100, None, sums) is False
    one_segment = {
        "segments": [
            {
                "total_size": 300,
                "segment_type": "small",
                "blocks": [
                    {"size": 60, "state": "inactive"},
                    {"size": 100, "state": "active_allocated"},
                    {"size": 60, "state": "inactive"},
                    {"size": 80, "state": "active_pending_free"},
                ],
            }
        ]
    }
    sums = totals(one_segment, 100)
    assert (sums.free_in_segments, sums.largest_free_block, sums.allocated) == (120, 60, 100)
    assert verdict(100, 0, sums) is True
    # Another pool's free blocks (a CUDA graph's) are not free for this request.
    one_segment["segments"][0]["segment_pool_id"] = (1, 3)
    assert verdict(100, 0, totals(one_segment, 100)) is False


def test_sites_group_live_blocks_by_the_jobs_line() -> None:
    sites, live = top_sites(load("fragmented")["snapshot"])
    assert live == 8 * 2 + 1 + 2 + 1 + 1  # active_allocated blocks only
    assert [(s.function, s.file.rsplit("/", 1)[-1], s.line) for s in sites] == [
        ("train_step", "train.py", 150),  # the optimizer's two moments
        ("forward", "model.py", 88),  # the MLP's activations, eight segments
        ("main", "train.py", 190),  # the weights
        ("recorded before history, in backward, or from C++", NO_STACK_FILE, 0),
        ("forward", "model.py", 61),
        ("train_step", "train.py", 131),
    ]
    by_line = {(s.file.rsplit("/", 1)[-1], s.line): s for s in sites}
    mlp = by_line[("model.py", 88)]
    assert (mlp.bytes, mlp.count) == (8 * (2 * GiB + 256 * MiB), 8)
    optimizer = by_line[("train.py", 150)]
    assert (optimizer.bytes, optimizer.count) == (27 * GiB, 2)
    assert (
        sum(s.bytes for s in sites)
        == load("fragmented")["memory_stats"]["allocated_bytes.all.current"]
    )
    assert by_line[(NO_STACK_FILE, 0)].stack == []


def test_site_stacks_show_torch_context_then_the_jobs_frames() -> None:
    sites, _ = top_sites(load("fragmented")["snapshot"])
    mlp = next(s for s in sites if s.line == 88)
    assert [f"{f.file.rsplit('/', 1)[-1]}:{f.line} {f.function}" for f in mlp.stack] == [
        "linear.py:125 forward",  # where in torch it allocated
        "model.py:88 forward",  # the site
        "model.py:131 forward",  # the job's callers; Module._call_impl between them is gone
        "train.py:142 train_step",
        "train.py:201 main",
        "train.py:215 <module>",
    ]
    for site in sites:
        assert len(site.stack) <= MAX_STACK_FRAMES


def test_sites_are_bounded() -> None:
    frames = [{"filename": f"/job/f{i}.py", "line": i, "name": "alloc"} for i in range(30)]
    blocks = [
        {"size": 1000 + i, "state": "active_allocated", "frames": frames[i:]} for i in range(30)
    ]
    sites, live = top_sites({"segments": [{"total_size": 0, "blocks": blocks}]})
    assert live == 30 and len(sites) == MAX_SITES
    assert sites[0].bytes == 1029 and all(len(s.stack) <= MAX_STACK_FRAMES for s in sites)


def test_library_frames() -> None:
    assert is_library_frame("/usr/lib/python3/dist-packages/torch/nn/modules/linear.py")
    assert is_library_frame("/x/site-packages/torch/_tensor.py")
    assert is_library_frame("<frozen runpy>")
    assert not is_library_frame("/home/alice/llm/train.py")
    assert not is_library_frame("/home/alice/torchvision_tricks/model.py")
    # torchtop's own code is not the job's; the demos it ships are.
    torchtop_dir = Path(torchtop.__file__).resolve().parent
    assert is_library_frame(str(torchtop_dir / "agent" / "oom" / "controller.py"))
    assert not is_library_frame(str(torchtop_dir / "demos" / "oom.py"))
    only_torch = [{"filename": "/x/site-packages/torch/nn/functional.py", "line": 1, "name": "f"}]
    assert [f.function for f in site_stack(only_torch)] == ["f"]


def test_saved_snapshot_opens_in_memory_viz(tmp_path: Path, fixture: dict[str, Any]) -> None:
    path = tmp_path / "r.oom-1.pickle"
    size = save_snapshot(fixture["snapshot"], path, trace_entries=1000, max_bytes=64 << 20)
    assert path.stat().st_size == size and path.stat().st_mode & 0o777 == 0o600
    with open(path, "rb") as f:
        data = pickle.load(f)
    # The functions behind `python -m torch.cuda._memory_viz stats|trace|memory|segments`.
    stats = _memory_viz.segsum(data)
    assert f"segments: {len(fixture['snapshot']['segments'])}" in stats
    assert "raise OutOfMemoryError" in _memory_viz.trace(data)
    flame = _memory_viz.memory(data, format_flamegraph=lambda lines: lines)
    assert "model.py:88:forward" in flame
    assert "stream_0;seg_" in _memory_viz.segments(data, format_flamegraph=lambda lines: lines)
    assert "<!DOCTYPE html>" in _memory_viz.trace_plot(data)  # the pages memory_viz serves
    assert "<!DOCTYPE html>" in _memory_viz.segment_plot(data)


def test_saving_is_bounded(tmp_path: Path) -> None:
    snap = load("fragmented")["snapshot"]
    assert len(bounded(snap, 5)["device_traces"][0]) == 5
    assert bounded(snap, 0)["device_traces"] == [[]]
    assert len(snap["device_traces"][0]) > 5  # the original is left alone
    whole = save_snapshot(snap, tmp_path / "a.pickle", trace_entries=10_000, max_bytes=1 << 30)
    cut = save_snapshot(snap, tmp_path / "b.pickle", trace_entries=10_000, max_bytes=whole - 1)
    with open(tmp_path / "b.pickle", "rb") as f:
        lean = pickle.load(f)
    assert cut < whole and lean["device_traces"] == [[]]
    tiny = save_snapshot(snap, tmp_path / "c.pickle", trace_entries=10_000, max_bytes=100)
    with open(tmp_path / "c.pickle", "rb") as f:
        bare = pickle.load(f)
    assert tiny < cut
    assert all(b["frames"] == [] for s in bare["segments"] for b in s["blocks"])
    _memory_viz.segsum(bare)
