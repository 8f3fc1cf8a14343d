"""The collector settings of a long-running viewer or exporter (:mod:`torchtop.streams.heap`)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from torchtop.streams.heap import EXPORTER_OLD_THRESHOLD, YOUNG_THRESHOLD, SettledHeap


@pytest.fixture
def defaults() -> Iterator[tuple[int, int, int]]:
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield gc.get_threshold()
    gc.unfreeze()
    gc.set_threshold(*before)


def test_settling_freezes_what_exists_and_release_gives_it_back(
    defaults: tuple[int, int, int],
) -> None:
    kept = [object() for _ in range(3)]
    heap = SettledHeap()
    heap.settle()
    assert gc.get_freeze_count() >= len(kept)
    assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
    heap.release()
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == defaults


def test_an_exporter_collects_its_oldest_generation_less_often(
    defaults: tuple[int, int, int],
) -> None:
    heap = SettledHeap(old=EXPORTER_OLD_THRESHOLD)
    heap.settle()
    assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, EXPORTER_OLD_THRESHOLD)
    heap.release()
    assert gc.get_threshold() == defaults


def test_one_settles_at_a_time_and_a_second_leaves_it_to_the_first(
    defaults: tuple[int, int, int],
) -> None:
    exporter, screen = SettledHeap(old=EXPORTER_OLD_THRESHOLD), SettledHeap()
    exporter.settle()
    screen.settle()  # a screen opened in the exporter's process: the exporter's settings stay
    assert gc.get_threshold()[2] == EXPORTER_OLD_THRESHOLD
    screen.release()
    assert gc.get_threshold()[2] == EXPORTER_OLD_THRESHOLD and gc.get_freeze_count() > 0
    exporter.release()
    assert gc.get_threshold() == defaults and gc.get_freeze_count() == 0
