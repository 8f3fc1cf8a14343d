"""The advice rules fire on their evidence, and only on it; sizes parse as people write them."""

from __future__ import annotations

import dataclasses

import pytest

from torchtop.model.oom_advice import (
    Evidence,
    grew_step_over_step,
    phase_at,
    step_floors,
    suggest,
    verdict_text,
)
from torchtop.protocol import AllocationSite, OutOfMemory, StackFrame
from torchtop.sizes import format_size, parse_size

GiB = 1 << 30
MiB = 1 << 20

SITE = AllocationSite("/job/train.py", 42, "make_batch", 3 * GiB, 1)
FORWARD = [
    StackFrame("/venv/site-packages/torch/nn/modules/linear.py", 125, "forward"),
    StackFrame("/job/model.py", 88, "forward"),
]


def full(**change: object) -> Evidence:
    base = Evidence(
        requested_bytes=2 * GiB,
        free_bytes=512 * MiB,
        total_bytes=80 * GiB,
        reserved_bytes=78 * GiB,
        allocated_bytes=77 * GiB,
        largest_free_block_bytes=256 * MiB,
        fragmented=False,
        emulated=False,
        grad_enabled=True,
        top_sites=[SITE],
        requested_stack=FORWARD,
    )
    return dataclasses.replace(base, **change)  # type: ignore[arg-type]


def ids(evidence: Evidence) -> list[str]:
    return [s.id for s in suggest(evidence)]


def test_full_in_training_suggests_batch_checkpointing_and_mixed_precision() -> None:
    suggestions = suggest(full())
    assert [s.id for s in suggestions] == ["batch-size", "checkpointing", "mixed-precision"]
    batch = suggestions[0]
    assert "2.00 GiB was requested with 512 MiB free of 80.0 GiB" in batch.evidence
    assert "4.0 times what is free" in batch.evidence
    assert "make_batch (train.py:42): 3.00 GiB in 1 allocation" in batch.evidence
    assert [s.demo_command for s in suggestions] == [
        "torchtop demo oom",
        "torchtop demo checkpointing",
        "torchtop demo mixed-precision",
    ]


def test_fragmented_suggests_expandable_segments_first_and_not_a_smaller_batch() -> None:
    evidence = full(fragmented=True, free_bytes=1 * GiB)
    suggestions = suggest(evidence)
    assert [s.id for s in suggestions] == ["expandable-segments"]
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in suggestions[0].title
    assert "1.00 GiB is free inside reserved segments" in suggestions[0].evidence
    assert "largest free block is 256 MiB" in suggestions[0].evidence
    assert suggestions[0].demo == "memory"


def test_an_emulated_device_never_suggests_the_allocator_setting() -> None:
    assert "expandable-segments" not in ids(full(fragmented=True, emulated=True))


def test_eval_with_grad_on_suggests_no_grad_and_not_checkpointing() -> None:
    assert ids(full(phase="eval")) == ["no-grad", "batch-size"]
    assert ids(full(phase="validation", grad_enabled=False)) == ["batch-size"]
    assert ids(full(phase="train")) == ["batch-size", "checkpointing", "mixed-precision"]
    no_grad = suggest(full(phase="eval"))[0]
    assert "phase 'eval' with autograd on" in no_grad.evidence and no_grad.demo == "autograd"


def test_growth_step_over_step_suggests_del_or_a_leak() -> None:
    growing = [10 * GiB, 20 * GiB, 30 * GiB, 40 * GiB, 50 * GiB]
    suggestions = suggest(full(floors=growing))
    assert suggestions[0].id == "leak"
    assert "rose from 10.0 GiB to 50.0 GiB" in suggestions[0].evidence
    assert suggestions[0].demo == "autograd"
    assert "leak" not in ids(full(floors=[50 * GiB, 50 * GiB, 51 * GiB, 50 * GiB, 50 * GiB]))


def test_no_checkpointing_when_the_failure_was_not_in_a_model() -> None:
    loading = [StackFrame("/job/data.py", 10, "load_all")]
    assert ids(full(requested_stack=loading)) == ["batch-size"]
    assert ids(full(requested_stack=[])) == ["batch-size", "checkpointing", "mixed-precision"]


def test_a_snapshot_gets_no_suggestions() -> None:
    assert suggest(full(requested_bytes=None)) == []


def test_growth_rule() -> None:
    assert grew_step_over_step([1, 2, 3, 4], 4) == (1, 4)
    assert grew_step_over_step([0, 0, 5, 6, 7, 8], 8) == (5, 8)  # start-up zeros skipped
    assert grew_step_over_step([1, 2, 3], 3) is None  # too few steps
    assert grew_step_over_step([5, 1, 2, 3, 4], 4) == (1, 4)  # the run that ends the series
    assert grew_step_over_step([100, 101, 102, 103], 1000) is None  # too small to matter
    assert grew_step_over_step([1, 2, 3, 2], 3) is None


def test_step_floors_use_step_boundaries_or_windows() -> None:
    points = [(t / 10, (t // 10) * 100 + (50 if t % 10 == 5 else 0)) for t in range(40)]
    assert step_floors(points, 4.0, boundaries=[0.95, 1.95, 2.95]) == [0, 100, 200, 300]
    windows = step_floors(points, 4.0)
    assert len(windows) == 6 and windows == sorted(windows)
    assert step_floors([], 1.0) == []
    assert step_floors([(5.0, 1)], 1.0) == []  # nothing before the failure


def test_phase_at_picks_the_innermost_open_phase() -> None:
    phases = [("train", 0.0, None), ("eval", 10.0, 20.0), ("epoch 2", 30.0, None)]
    assert phase_at(phases, 15.0) == "eval"
    assert phase_at(phases, 25.0) == "train"
    assert phase_at(phases, 35.0) == "epoch 2"
    assert phase_at([("warmup", None, 1.0)], 0.5) == "warmup"
    assert phase_at(phases, -1.0) is None


def _oom(**change: object) -> OutOfMemory:
    base = OutOfMemory(
        t=1.0,
        id=1,
        device="cuda:0",
        emulated=False,
        requested_bytes=2 * GiB,
        free_bytes=1 * GiB,
        total_bytes=80 * GiB,
        reserved_bytes=78 * GiB,
        allocated_bytes=64 * GiB,
        largest_free_block_bytes=1536 * MiB,
        fragmented=True,
        top_sites=[],
        snapshot_path=None,
    )
    return dataclasses.replace(base, **change)  # type: ignore[arg-type]


def test_verdict_text_fits_a_line() -> None:
    fragmented = verdict_text(_oom())
    assert (
        fragmented
        == "Fragmented: 15.0 GiB free, but the largest free block is 1.50 GiB < 2.00 GiB."
    )
    full_text = verdict_text(_oom(fragmented=False, reserved_bytes=64 * GiB))
    assert full_text == "Full: 2.00 GiB requested; all free memory, cache included, is 1.00 GiB."
    emulated = verdict_text(
        _oom(fragmented=False, emulated=True, requested_bytes=256 * MiB, free_bytes=126 * MiB)
    )
    assert emulated == "Full: 256 MiB requested, only 126 MiB free (emulated: it cannot fragment)."
    assert all(len(t) <= 78 for t in (fragmented, full_text, emulated))
    assert "no verdict" in verdict_text(_oom(fragmented=None, requested_bytes=None))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("256MiB", 256 * MiB),
        ("2GiB", 2 * GiB),
        ("2 gib", 2 * GiB),
        ("500MB", 500_000_000),
        ("1e9", 1_000_000_000),
        ("1.5G", 1_500_000_000),
        ("4096", 4096),
        ("64k", 64_000),
        ("1KiB", 1024),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lots", "expected a size such as 256MiB"),
        ("12XB", "unknown unit 'XB'"),
        ("0", "at least one byte"),
        ("-5MiB", "expected a size"),
        ("", "expected a size"),
    ],
)
def test_parse_size_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_size(text)


def test_format_size_as_cuda_writes_it() -> None:
    assert format_size(256 * MiB) == "256.00 MiB"
    assert format_size(100) == "100 bytes"
    assert format_size(int(1.5 * GiB)) == "1.50 GiB"


def test_the_viewer_side_and_the_oom_agent_modules_import_no_torch() -> None:
    import json
    import subprocess
    import sys

    modules = [
        "torchtop.model.oom_advice",
        "torchtop.report.job",
        "torchtop.sizes",
        "torchtop.model.captures",
        "torchtop.tui.screens.oom",
        "torchtop.agent.oom",  # imports torch only once the job has
        "torchtop.agent.memory_snapshot",
    ]
    code = f"import json, sys, {', '.join(modules)}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "torch" not in json.loads(out.stdout)


def test_report_events_carry_the_evidence() -> None:
    from torchtop.model import JobModel
    from torchtop.protocol import MemoryStats, OomResumed, PhaseBegan, Sample
    from torchtop.report.job import capture_parts, report_json

    model = JobModel()
    for i in range(60):  # allocated grows step over step
        stats = MemoryStats("cuda:0", "cuda-allocator", (10 + i // 10 * 5) * GiB, 80 * GiB)
        model.apply(Sample(float(i), None, [stats]))
    model.apply(PhaseBegan(55.0, "eval", 1))
    model.apply(
        _oom(
            t=59.5,
            fragmented=False,
            grad_enabled=True,
            top_sites=[SITE],
            snapshot_path="/runs/r.oom-1.pickle",
        )
    )
    model.apply(OomResumed(70.0, 1, "timeout"))
    (event,) = report_json(model)["events"]
    assert event["kind"] == "oom" and event["t_s"] == 59.5 and event["phase"] == "eval"
    assert event["top_sites"] == [
        {
            "file": "/job/train.py",
            "line": 42,
            "function": "make_batch",
            "bytes": 3 * GiB,
            "count": 1,
            "stack": [],
        }
    ]
    assert [s["id"] for s in event["suggestions"]] == ["no-grad", "leak", "batch-size"]
    assert event["suggestions"][0]["demo"] == "torchtop demo autograd"
    assert event["resumed"] == "timeout" and event["snapshot_path"] == "/runs/r.oom-1.pickle"
    text = "".join(str(part) for part in capture_parts([event]))
    assert "out of memory on cuda:0" in text and "make_batch (train.py:42)" in text


def split(*gib: int) -> dict[str, int]:
    """Parameters, gradients, optimizer state and other allocated, in GiB."""
    names = ("parameters", "gradients", "optimizer_state", "other_allocated")
    return {name: n * GiB for name, n in zip(names, gib, strict=True)}


def test_optimizer_state_dominant_names_sharded_or_8bit_states_with_the_bytes_first() -> None:
    suggestions = suggest(full(by_category=split(10, 10, 40, 17)))
    assert suggestions[0].id == "sharded-optimizer"
    assert "Optimizer state held 40.0 GiB of the 77.0 GiB allocated (52%)" in (
        suggestions[0].evidence
    )
    assert "free about 30.0 GiB" in suggestions[0].evidence
    assert suggestions[0].demo_command == "torchtop demo holders"  # SGD's state against Adam's


def test_activations_dominant_put_checkpointing_first() -> None:
    assert ids(full(by_category=split(2, 2, 4, 69))) == [
        "checkpointing",
        "batch-size",
        "mixed-precision",
    ]


@pytest.mark.parametrize(
    ("dominant", "rule"),
    [("gradients", "grads-set-to-none"), ("parameters", "lower-precision-parameters")],
)
def test_gradients_or_parameters_dominant_get_their_fix(dominant: str, rule: str) -> None:
    held = split(1, 1, 1, 1)
    held[dominant] = 70 * GiB
    assert ids(full(by_category=held))[0] == rule


def test_the_verdict_says_what_held_the_memory() -> None:
    from torchtop.protocol import CategoryBytes

    oom = OutOfMemory(
        t=1.0, id=1, device="cpu", emulated=True, requested_bytes=64 * MiB,
        free_bytes=MiB, total_bytes=256 * MiB, reserved_bytes=255 * MiB,
        allocated_bytes=255 * MiB, largest_free_block_bytes=None, fragmented=False,
        top_sites=[], snapshot_path=None,
        by_category=[CategoryBytes("parameters", 51 * MiB), CategoryBytes("gradients", 51 * MiB),
                     CategoryBytes("optimizer_state", 102 * MiB),
                     CategoryBytes("other_allocated", 51 * MiB)],
    )  # fmt: skip
    assert verdict_text(oom).endswith(
        "Held by: optimizer state 102 MiB (40%), parameters 51.0 MiB (20%), "
        "gradients 51.0 MiB (20%), activations and temporaries 51.0 MiB (20%)."
    )
