"""What to change after an out-of-memory failure: rules tied to the evidence. Pure Python.

No torch, Textual or Rich: the viewer's OOM screen and ``torchtop report`` use the same rules,
and the tests drive them with plain values. Each :class:`Suggestion` names the evidence that
triggered it, in numbers, and the demo that shows the fix (``torchtop demo NAME``).

The evidence is an :class:`Evidence`: the ``oom`` event's figures, the phase the failure came
in, whether autograd was on, and the device's allocated memory at the low point of each step
before it (:func:`step_floors`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from torchtop.protocol import AllocationSite, MemoryCapture, StackFrame
from torchtop.sizes import format_bytes

#: Phases whose names say the model is evaluated, not trained.
EVAL_PHASE = re.compile(r"eval|valid|\bval\b|^val|test|infer|predict|generat", re.IGNORECASE)
#: Floors must rise this many times in a row, by this share of the allocated memory in all,
#: to count as growth step over step.
GROWTH_RUN = 3
GROWTH_SHARE = 0.10
#: Without step boundaries, the time before the OOM is cut into this many windows.
FALLBACK_WINDOWS = 6
FALLBACK_SPAN_S = 60.0


@dataclass(frozen=True)
class Suggestion:
    """One thing to try: ``title`` says what, ``evidence`` why (in numbers), ``how`` with what,
    and ``demo`` names the demo that shows it."""

    id: str
    title: str
    evidence: str
    how: str
    demo: str

    @property
    def demo_command(self) -> str:
        return f"torchtop demo {self.demo}"


@dataclass(frozen=True)
class Evidence:
    """What is known of one failure."""

    requested_bytes: int | None
    free_bytes: int | None
    total_bytes: int | None
    reserved_bytes: int | None
    allocated_bytes: int | None
    largest_free_block_bytes: int | None
    fragmented: bool | None
    emulated: bool
    grad_enabled: bool | None = None
    #: The innermost phase open at the failure (``torchtop.phase``), if any.
    phase: str | None = None
    #: Allocated bytes at the low point of each step (or time window) before the failure.
    floors: Sequence[int] = ()
    top_sites: Sequence[AllocationSite] = ()
    requested_stack: Sequence[StackFrame] = ()
    #: The failure came in a backward pass (where autograd is off while it runs).
    in_backward: bool | None = None
    #: What held the allocated memory at the failure, by category (empty: not known).
    by_category: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def of(
        cls, capture: MemoryCapture, *, phase: str | None = None, floors: Sequence[int] = ()
    ) -> Evidence:
        return cls(
            requested_bytes=capture.requested_bytes,
            free_bytes=capture.free_bytes,
            total_bytes=capture.total_bytes,
            reserved_bytes=capture.reserved_bytes,
            allocated_bytes=capture.allocated_bytes,
            largest_free_block_bytes=capture.largest_free_block_bytes,
            fragmented=capture.fragmented,
            emulated=capture.emulated,
            grad_enabled=capture.grad_enabled,
            phase=phase,
            floors=list(floors),
            top_sites=list(capture.top_sites),
            requested_stack=list(capture.requested_stack),
            by_category={c.category: c.bytes for c in capture.by_category},
            in_backward=capture.in_backward,
        )

    @property
    def dominant(self) -> tuple[str, int] | None:
        """The category holding the most of allocated at the failure, and its bytes."""
        if not self.by_category:
            return None
        return max(self.by_category.items(), key=lambda item: item[1])


def size(n: int | None) -> str:
    """A size in the model's sentences: :func:`torchtop.sizes.format_bytes` (``512 MiB``,
    ``15.0 GiB``, ``1.50 GiB``), and ``?`` for one that could not be read."""
    return format_bytes(n, missing="?")


# -- the verdict --------------------------------------------------------------------------------


#: How the split names its categories in sentences.
CATEGORY_NAMES = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "other_allocated": "activations and temporaries",
}


def held_text(capture: MemoryCapture) -> str:
    """What held the allocated memory at the failure, largest first ("" when not known)."""
    total = sum(c.bytes for c in capture.by_category)
    if total <= 0:
        return ""
    parts = [
        f"{CATEGORY_NAMES.get(c.category, c.category)} {size(c.bytes)} ({c.bytes / total:.0%})"
        for c in sorted(capture.by_category, key=lambda c: -c.bytes)
        if c.bytes > 0
    ]
    return "Held by: " + ", ".join(parts) + "."


def verdict_text(capture: MemoryCapture, *, held: bool = True) -> str:
    """The verdict in one short sentence: fragmented, full, or why it cannot be told; then
    what held the memory, where known (and ``held``: the OOM screen draws it as a bar)."""
    held_by = held_text(capture) if held else ""
    text = _verdict(capture)
    return f"{text} {held_by}" if held_by else text


def _verdict(capture: MemoryCapture) -> str:
    req, free = capture.requested_bytes, capture.free_bytes
    cached = max(0, (capture.reserved_bytes or 0) - (capture.allocated_bytes or 0))
    if capture.fragmented is True:
        return (
            f"Fragmented: {size((free or 0) + cached)} free, but the largest free block is "
            f"{size(capture.largest_free_block_bytes)} < {size(req)}."
        )
    if capture.fragmented is False:
        if capture.emulated:
            return (
                f"Full: {size(req)} requested, only {size(free)} free "
                "(emulated: it cannot fragment)."
            )
        return (
            f"Full: {size(req)} requested; all free memory, cache included, is "
            f"{size((free or 0) + cached)}."
        )
    if req is None:
        return "A snapshot on request: nothing failed, so there is no verdict."
    return "No verdict: the allocator's segments could not be read."


# -- evidence from the time series ---------------------------------------------------------------


def step_floors(
    points: Iterable[tuple[float, int | None]],
    until: float,
    boundaries: Iterable[float] = (),
) -> list[int]:
    """Allocated bytes at the low point of each step before ``until``.

    ``points`` are ``(t, allocated)`` samples; ``boundaries`` step ends, if known. Steps with
    no sample are skipped; with fewer than three steps sampled, the last minute (or all there
    is) is cut into equal windows instead.
    """
    before = [(t, v) for t, v in points if v is not None and t <= until]
    if not before:
        return []
    edges = sorted(b for b in boundaries if before[0][0] <= b <= until)
    floors = _floors(before, edges)
    if len(floors) >= GROWTH_RUN:
        return floors
    start = max(before[0][0], until - FALLBACK_SPAN_S)
    width = (until - start) / FALLBACK_WINDOWS
    if width <= 0:
        return []
    edges = [start + width * k for k in range(1, FALLBACK_WINDOWS)]
    return _floors([(t, v) for t, v in before if t >= start], edges)


def _floors(points: Sequence[tuple[float, int]], edges: Sequence[float]) -> list[int]:
    floors: list[int] = []
    current: int | None = None
    index = 0
    for t, value in points:
        while index < len(edges) and t > edges[index]:
            if current is not None:
                floors.append(current)
            current = None
            index += 1
        current = value if current is None else min(current, value)
    if current is not None:
        floors.append(current)
    return floors


def grew_step_over_step(floors: Sequence[int], allocated: int | None) -> tuple[int, int] | None:
    """``(first, last)`` of the run of rising floors that ends the series, when it rose at
    least :data:`GROWTH_RUN` times in a row by :data:`GROWTH_SHARE` of the allocated memory."""
    floors = list(floors)
    while floors and floors[0] == 0:
        floors.pop(0)  # before the job allocated anything: start-up, not growth
    if len(floors) < GROWTH_RUN + 1:
        return None
    run = 0
    for a, b in zip(floors[-2::-1], floors[:0:-1], strict=True):
        if b > a:
            run += 1
        else:
            break
    if run < GROWTH_RUN:
        return None
    first, last = floors[-1 - run], floors[-1]
    scale = max(allocated or 0, last)
    if scale <= 0 or (last - first) < GROWTH_SHARE * scale:
        return None
    return first, last


def phase_at(phases: Iterable[tuple[str, float | None, float | None]], t: float) -> str | None:
    """The innermost phase open at ``t`` (the latest to begin), from ``(name, start, end)``."""
    best: tuple[float, str] | None = None
    for name, start, end in phases:
        begun = start if start is not None else float("-inf")
        if begun <= t and (end is None or end >= t) and (best is None or begun >= best[0]):
            best = (begun, name)
    return best[1] if best is not None else None


# -- the rules ----------------------------------------------------------------------------------


def _in_forward_or_backward(evidence: Evidence) -> bool:
    """The failing allocation came from a model's forward or backward (its stack says so), or
    its stack is unknown (then training is the likely place)."""
    stack = evidence.requested_stack
    if not stack:
        return True
    words = ("forward", "backward", "__call__", "_call_impl", "checkpoint")
    return any(any(w in f.function for w in words) or "nn/modules" in f.file for f in stack)


def suggest(evidence: Evidence) -> list[Suggestion]:
    """What to try, most specific first. Each rule fires only on its evidence."""
    out: list[Suggestion] = []
    req = evidence.requested_bytes
    if req is None:
        return out
    top = evidence.top_sites[0] if evidence.top_sites else None
    where = (
        f" The largest holder is {top.function} ({_short(top.file)}:{top.line}): "
        f"{size(top.bytes)} in {top.count} allocation{'s' if top.count != 1 else ''}."
        if top is not None
        else ""
    )

    out.extend(_by_holder(evidence))
    if evidence.fragmented and not evidence.emulated:
        in_segments = (evidence.reserved_bytes or 0) - (evidence.allocated_bytes or 0)
        out.append(
            Suggestion(
                id="expandable-segments",
                title="Let the allocator grow segments: "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                evidence=f"{size(in_segments)} is free inside reserved segments, but the largest "
                f"free block is {size(evidence.largest_free_block_bytes)} and {size(req)} "
                "was requested: the memory is there, in pieces.",
                how="Set it in the environment before the job starts; expandable segments "
                "map more memory into one segment instead of leaving gaps between segments.",
                demo="memory",
            )
        )

    phase = evidence.phase
    if phase is not None and EVAL_PHASE.search(phase) and evidence.grad_enabled:
        out.append(
            Suggestion(
                id="no-grad",
                title="Evaluate under torch.no_grad() (or torch.inference_mode())",
                evidence=f"The OOM came in phase {phase!r} with autograd on: every activation "
                "was kept for a backward pass that evaluation never runs.",
                how="with torch.no_grad():\n    outputs = model(batch)",
                demo="autograd",
            )
        )

    growth = grew_step_over_step(evidence.floors, evidence.allocated_bytes)
    if growth is not None:
        first, last = growth
        out.append(
            Suggestion(
                id="leak",
                title="Memory grew step over step: free what you keep (del), or find the leak",
                evidence=f"Allocated memory at the low point of each step rose from "
                f"{size(first)} to {size(last)} before the OOM, every step.{where}",
                how="Keep numbers, not tensors: loss.item(), tensor.detach(); del batches and "
                "outputs you no longer need; don't append tensors that carry a graph to a list.",
                demo="autograd",
            )
        )

    if not evidence.fragmented:
        free = evidence.free_bytes
        share = (
            f" (needs {req / free:.1f} times what is free)"
            if free and free > 0 and req > free
            else ""
        )
        out.append(
            Suggestion(
                id="batch-size",
                title="Reduce the batch size",
                evidence=f"{size(req)} was requested with {size(free)} free of "
                f"{size(evidence.total_bytes)}{share}; activations grow with the batch.{where}",
                how="Halve it; keep the effective batch with gradient accumulation "
                "(loss / k, step the optimizer every k batches).",
                demo="oom",
            )
        )
        # The job holds gradients: it trains (under --memory-limit the failing thread's grad
        # mode can read off inside the tracker's dispatch, so it is not the only witness).
        trains = bool(evidence.in_backward) or evidence.by_category.get("gradients", 0) > 0
        training = (evidence.grad_enabled is not False or trains) and not (
            phase is not None and EVAL_PHASE.search(phase)
        )
        dominant = evidence.dominant
        activations = dominant is not None and dominant[0] == "other_allocated"
        if training and (activations or _in_forward_or_backward(evidence)):
            out.append(
                Suggestion(
                    id="checkpointing",
                    title="Gradient checkpointing: recompute activations in backward",
                    evidence="The failure came while the model ran with autograd on, when "
                    "activations saved for backward fill the memory.",
                    how="torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) "
                    "around the largest blocks: memory for compute.",
                    demo="checkpointing",
                )
            )
            out.append(
                Suggestion(
                    id="mixed-precision",
                    title="Mixed precision: bfloat16/float16 activations",
                    evidence="Activations in float32 take twice the memory of 16-bit ones.",
                    how="with torch.autocast(device_type, dtype=torch.bfloat16): loss = ...",
                    demo="mixed-precision",
                )
            )
        if activations:  # activations held the most: recomputing them comes first
            out.sort(key=lambda s: s.id != "checkpointing")
    return out


def _by_holder(evidence: Evidence) -> list[Suggestion]:
    """The fix for what held most of the memory, with the bytes it would free (activations
    dominant: the checkpointing rule, which :func:`suggest` then puts first)."""
    dominant = evidence.dominant
    if dominant is None:
        return []
    category, held = dominant
    total = sum(evidence.by_category.values())
    share = f"{size(held)} of the {size(total)} allocated ({held / total:.0%})"
    if category == "optimizer_state":
        return [
            Suggestion(
                id="sharded-optimizer",
                title="Shrink the optimizer state: shard it (ZeRO / FSDP) or keep it in 8 bits",
                evidence=f"Optimizer state held {share} at the failure. 8-bit states "
                f"(bitsandbytes' Adam8bit) would free about {size(held * 3 // 4)}; sharding "
                f"over N ranks frees (N-1)/N of it.",
                how="torch.distributed.optim.ZeroRedundancyOptimizer(params, torch.optim.AdamW) "
                "or FSDP/fully_shard; or bnb.optim.AdamW8bit(params); SGD with momentum keeps "
                "one state tensor instead of Adam's two.",
                demo="holders",
            )
        ]
    if category == "gradients":
        return [
            Suggestion(
                id="grads-set-to-none",
                title="Free gradients between steps: zero_grad(set_to_none=True)",
                evidence=f"Gradients held {share} at the failure; set to None they are freed "
                f"until the next backward (up to {size(held)}).",
                how="optimizer.zero_grad(set_to_none=True); accumulate in place over "
                "micro-batches rather than keeping copies.",
                demo="memory",
            )
        ]
    if category == "parameters":
        return [
            Suggestion(
                id="lower-precision-parameters",
                title="Hold the parameters in lower precision, or shard them",
                evidence=f"Parameters held {share} at the failure; in bfloat16 they would "
                f"take {size(held // 2)} less.",
                how="model.to(torch.bfloat16) (with a float32 master copy in the optimizer if "
                "needed), or FSDP/fully_shard to hold a shard per rank.",
                demo="mixed-precision",
            )
        ]
    return []


def _short(path: str) -> str:
    return path.rsplit("/", 1)[-1]
