"""Each teaching demo runs under the agent with ``--headless --quick``, prints its conclusion,
and measures its effect the right way round.

The checks are directions (this peak below that one, this loop slower than that op), never
figures: the numbers depend on the machine. Speed is asserted only where the gap is orders of
magnitude (a Python loop against one op); mixed precision's speed on a CPU can go either way.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from demo_runner import Results, peak, run_demo, seconds, shown_results

# -- what each demo must show ----------------------------------------------------------------


def check_tensors(r: Results) -> None:
    copy = peak(r, "permute().contiguous() (copy)")
    assert copy > 0
    assert peak(r, "view (no copy)") <= copy // 100  # a view allocates (next to) nothing
    assert peak(r, "index [:, :, evens] (copy)") > peak(r, "slice [:, :, ::2] (no copy)")
    assert r["view (no copy)"]["extra"]["copies"] == "no"
    assert r["index [:, :, evens] (copy)"]["extra"]["copies"] == "yes"


def check_vectorization(r: Results) -> None:
    loop = seconds(r, "Python loop over rows")
    assert seconds(r, "vectorized (A * x).sum(1)") < loop
    assert seconds(r, "torch.matmul") < loop


def check_inplace(r: Results) -> None:
    assert peak(r, "avg.mul_(0.9).add_(new, alpha=0.1)") < peak(r, "avg = avg * 0.9 + new * 0.1")
    assert peak(r, "avg.zero_()") < peak(r, "avg = torch.zeros_like(avg)")
    # The in-place version of sigmoid() * 2 failed in backward, and the demo caught it.
    assert r["sigmoid().mul_(2), backward"]["extra"]["backward"] == "RuntimeError"
    assert r["sigmoid() * 2, backward"]["extra"]["backward"] == "ok"


def check_autograd(r: Results) -> None:
    grad = r["grad on"]
    assert grad["extra"]["graph"] == "yes"
    for name in ("no_grad()", "inference_mode()"):
        assert r[name]["extra"]["graph"] == "no"
        assert r[name]["extra"]["held after"] < grad["extra"]["held after"]
        assert peak(r, name) < peak(r, "grad on")


def check_memory(r: Results) -> None:
    assert peak(r, "del as you go") < peak(r, "intermediates kept")
    leaky, flat = r["total_loss += loss"]["extra"], r["total_loss += loss.item()"]["extra"]
    assert leaky["per step"] > 0
    assert leaky["at end"] > flat["at end"]
    assert flat["per step"] * 10 < leaky["per step"]  # flat: no growth to speak of
    assert peak(r, "total_loss += loss.item()") < peak(r, "total_loss += loss")


def check_checkpointing(r: Results) -> None:
    plain = peak(r, "no checkpointing")
    assert peak(r, "checkpoint every block") < plain
    segments = next(name for name in r if name.endswith(" segments"))
    assert peak(r, segments) < plain


def check_mixed_precision(r: Results) -> None:
    full = r["float32"]
    low_name = next(name for name in r if name.endswith(" autocast"))
    low = r[low_name]
    assert low["extra"]["activations"] < full["extra"]["activations"]
    assert low["peak_bytes"] < full["peak_bytes"]
    # Both trained: a finite loss, and close to float32's (bfloat16 keeps ~3 digits).
    loss_key = next(key for key in full["extra"] if key.startswith("loss"))
    assert abs(low["extra"][loss_key] - full["extra"][loss_key]) < 0.05 * full["extra"][loss_key]


#: demo name -> (the start of its conclusion line, the checks on its measured values)
DEMOS: dict[str, tuple[str, Callable[[Results], None]]] = {
    "tensors": ("view took ", check_tensors),
    "vectorization": ("the vectorized version ran ", check_vectorization),
    "inplace": ("the in-place update used ", check_inplace),
    "autograd": ("after the forward, grad on held ", check_autograd),
    "memory": ("del as you go used ", check_memory),
    "checkpointing": ("checkpointing every block used ", check_checkpointing),
    "mixed-precision": ("bfloat16 autocast held ", check_mixed_precision),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DEMOS))
def test_demo_runs_and_measures_the_effect(name: str) -> None:
    output = run_demo(name)
    conclusion_start, check = DEMOS[name]
    results = shown_results(output, conclusion_start)
    check(results)
