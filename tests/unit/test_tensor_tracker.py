"""TensorTracker counts live and peak tensor storage bytes exactly, once per storage."""

from __future__ import annotations

import gc
import statistics
import time

import pytest
import torch

from torchtop.agent.tensor_tracker import TensorTracker

N = 1000
MATRIX_BYTES = N * N * 4  # float32


@pytest.fixture
def xy() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(N, N), torch.randn(N, N)


def test_pre_existing_tensors_are_not_counted(xy: tuple[torch.Tensor, torch.Tensor]) -> None:
    with TensorTracker() as tr:
        pass
    assert tr.live_bytes == 0
    assert tr.peak_bytes == 0


def test_new_result_adds_exactly_its_bytes(xy: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = xy
    with TensorTracker() as tr:
        z = x + y
        assert tr.live_bytes == MATRIX_BYTES == 4_000_000
    assert tr.peak_bytes == MATRIX_BYTES
    assert z.shape == (N, N)


def test_views_add_nothing(xy: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = xy
    with TensorTracker() as tr:
        z = x + y
        before = tr.live_bytes
        views = [z.view(-1), z[:10], z[:, 3], z.t(), z.unsqueeze(0).expand(3, N, N), z.detach()]
        row = torch.ones(1, N)
        with_row = tr.live_bytes
        views.append(row.expand(N, N))
        views.append(x.view(-1))  # a view of a pre-existing tensor
        assert tr.live_bytes == with_row == before + N * 4
    assert len(views) == 8


def test_contiguous_of_a_non_contiguous_view_adds_its_bytes(
    xy: tuple[torch.Tensor, torch.Tensor],
) -> None:
    x, _ = xy
    with TensorTracker() as tr:
        already = x.contiguous()  # already contiguous: returns x itself
        assert tr.live_bytes == 0
        transposed = x.t().contiguous()
        assert tr.live_bytes == MATRIX_BYTES
        column = x[:, :10].contiguous()
        assert tr.live_bytes == MATRIX_BYTES + N * 10 * 4
        row = torch.ones(1, N)
        expanded = row.expand(N, N).contiguous()
        assert tr.live_bytes == MATRIX_BYTES + N * 10 * 4 + N * 4 + MATRIX_BYTES
        del row  # the temporary row is freed; the materialized copy stays
        assert tr.live_bytes == MATRIX_BYTES + N * 10 * 4 + MATRIX_BYTES
    assert already is x
    assert transposed.is_contiguous() and column.is_contiguous() and expanded.is_contiguous()


def test_del_returns_live_bytes_to_before(xy: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = xy
    with TensorTracker() as tr:
        keep = x * 3
        before = tr.live_bytes
        z = x + y
        view = z[1:]
        assert tr.live_bytes == before + MATRIX_BYTES
        del z
        assert tr.live_bytes == before + MATRIX_BYTES  # the view still holds the storage
        del view
        assert tr.live_bytes == before
    del keep
    gc.collect()
    assert tr.live_bytes == 0  # storages that die after the block are subtracted too
    assert tr.live_storages == 0


def test_peak_captures_a_transient_intermediate(xy: tuple[torch.Tensor, torch.Tensor]) -> None:
    a, _ = xy
    with TensorTracker() as tr:
        total = (a * 2).sum()
    assert tr.peak_bytes >= a.numel() * a.element_size()
    assert tr.live_bytes == total.element_size()  # only the scalar result remains


def test_in_place_ops_add_nothing(xy: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = xy
    with TensorTracker() as tr:
        z = x + y
        z.add_(1).mul_(2)
        z[:, 0].fill_(0.0)
        x.add_(y)  # a pre-existing tensor changed in place
        torch.relu_(z)
        assert tr.live_bytes == MATRIX_BYTES
    assert tr.peak_bytes == MATRIX_BYTES


def test_reset_peak(xy: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = xy
    with TensorTracker() as tr:
        z = x + y
        del z
        assert tr.peak_bytes == MATRIX_BYTES
        tr.reset_peak()
        assert tr.peak_bytes == tr.live_bytes == 0
        small = x[:10] * 2
        assert tr.peak_bytes == 10 * N * 4
    assert small.shape == (10, N)


def test_resize_and_set(xy: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, _ = xy
    with TensorTracker() as tr:
        buf = torch.empty(0)  # zero-size: nothing yet
        assert tr.live_bytes == 0
        buf.resize_(1000)
        assert tr.live_bytes == 4000
        buf.resize_(N, N)  # a counted storage grows: counted once, at its new size
        assert tr.live_bytes == MATRIX_BYTES
        assert tr.live_storages == 1
        out = torch.empty(0)
        torch.add(x, x, out=out)  # out= allocates inside the block
        assert tr.live_bytes == 2 * MATRIX_BYTES
        other = torch.zeros(10)
        buf.set_(other)  # type: ignore[call-overload]  # buf's old storage is freed
        assert tr.live_bytes == MATRIX_BYTES + 40
        alias = torch.empty(0)
        alias.set_(x.untyped_storage())  # a pre-existing storage: still not counted
        alias.set_(x.untyped_storage(), 0, (10,), (1,))
        assert tr.live_bytes == MATRIX_BYTES + 40
    del buf, other, out
    assert tr.live_bytes == 0
    assert alias.data_ptr() == x.data_ptr()


def test_tensor_literal_and_factories_are_counted() -> None:
    with TensorTracker() as tr:
        lit = torch.tensor([1.0, 2.0, 3.0])
        zeros = torch.zeros(10, dtype=torch.float64)
        meta = torch.zeros(1000, device="meta")
        empty = torch.empty(0)
    assert tr.live_bytes == 12 + 80
    assert lit.numel() + zeros.numel() + meta.numel() + empty.numel() == 1013


def test_autograd_saved_tensors_stay_counted_until_the_graph_dies() -> None:
    w = torch.randn(N, N, requires_grad=True)
    with TensorTracker() as tr:
        hidden = w * 2
        loss = hidden.sin().sum()
        del hidden
        assert tr.live_bytes >= MATRIX_BYTES  # sin() saved its input for backward
        loss.backward()
    assert w.grad is not None
    del loss
    gc.collect()
    assert tr.live_bytes == MATRIX_BYTES  # the gradient, made in backward inside the block
    w.grad = None
    assert tr.live_bytes == 0


def test_nested_trackers_each_count_their_own_block(
    xy: tuple[torch.Tensor, torch.Tensor],
) -> None:
    x, y = xy
    with TensorTracker() as outer:
        first = x + y
        with TensorTracker() as inner:
            second = x - y
        assert inner.live_bytes == MATRIX_BYTES
        assert outer.live_bytes == 2 * MATRIX_BYTES
    del first, second
    assert inner.live_bytes == outer.live_bytes == 0
    assert outer.peak_bytes == 2 * MATRIX_BYTES


def test_overhead_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    """Prints the tracker's cost on tiny ops for the module docstring; asserts nothing about it."""
    a, b = torch.ones(16), torch.ones(16)
    ops = 5000

    def loop() -> None:
        for _ in range(ops):
            a + b

    def per_op(tracked: bool) -> float:
        start = time.perf_counter()
        if tracked:
            with TensorTracker():
                loop()
        else:
            loop()
        return (time.perf_counter() - start) / ops

    per_op(True)  # warm up the dispatch machinery
    plain = statistics.median(per_op(False) for _ in range(5))
    tracked = statistics.median(per_op(True) for _ in range(5))
    with capsys.disabled():
        print(
            f"\nTensorTracker overhead on `a + b` (16 floats): {plain * 1e6:.1f} us/op without, "
            f"{tracked * 1e6:.1f} us/op with, {tracked / plain:.1f}x"
        )
    assert tracked > 0
