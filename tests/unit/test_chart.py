"""The braille chart as a pure function: data in, text out."""

from __future__ import annotations

import pytest

from torchtop.tui.widgets.chart import (
    AXIS_WIDTH,
    ChartMark,
    ChartSeries,
    ChartSpan,
    render_chart,
)

GiB = 1 << 30
BRAILLE = range(0x2800, 0x2900)


def lines(text: str) -> list[str]:
    return text.split("\n")


def ramp(n: int = 100, top: float = 8 * GiB) -> list[tuple[float, float | None]]:
    return [(float(i), top * i / (n - 1)) for i in range(n)]


def plot_cells(rendered: str) -> str:
    """Every plot character (axis column and phase row left out)."""
    return "".join(line[AXIS_WIDTH:] for line in lines(rendered)[:-1])


@pytest.mark.parametrize(("width", "height"), [(60, 8), (80, 12), (20, 3), (11, 2), (40, 1)])
def test_exact_dimensions(width: int, height: int) -> None:
    series = [ChartSeries("allocated", ramp(), "cyan", fill=True)]
    text = render_chart(series, width=width, height=height, t_start=0, t_end=99).plain
    rows = lines(text)
    assert len(rows) == height
    assert all(len(row) == width for row in rows), [len(r) for r in rows]


def test_degenerate_sizes_render_nothing() -> None:
    assert render_chart([], width=0, height=5, t_start=0, t_end=1).plain == ""
    assert render_chart([], width=40, height=0, t_start=0, t_end=1).plain == ""


def test_empty_data_draws_axes_and_blank_plot() -> None:
    text = render_chart([], width=40, height=5, t_start=0, t_end=120).plain
    rows = lines(text)
    assert len(rows) == 5
    assert rows[0][:AXIS_WIDTH] == "     │"  # no data, no scale
    assert rows[-2][:AXIS_WIDTH] == "    0┤"
    assert plot_cells(text).strip() == ""
    assert "-120s" in rows[-1]


def test_series_with_only_gaps_is_blank() -> None:
    series = [ChartSeries("allocated", [(0.0, None), (1.0, None)], "cyan", fill=True)]
    text = render_chart(series, width=30, height=4, t_start=0, t_end=1).plain
    assert plot_cells(text).strip() == ""


def test_y_axis_top_label_is_a_round_byte_count() -> None:
    series = [ChartSeries("allocated", [(0.0, 1.73 * GiB), (1.0, 1.0 * GiB)], "cyan")]
    rows = lines(render_chart(series, width=40, height=5, t_start=0, t_end=1).plain)
    assert rows[0][:AXIS_WIDTH] == " 1.8G┤"
    assert rows[-2][:AXIS_WIDTH] == "    0┤"


def test_fill_covers_the_area_under_the_curve() -> None:
    flat = [(float(t), 4.0 * GiB) for t in range(11)]
    series = [ChartSeries("allocated", flat, "cyan", fill=True)]
    text = render_chart(series, width=26, height=5, t_start=0, t_end=10, y_max=4 * GiB).plain
    plot = lines(text)[:-1]
    for row in plot:
        assert set(row[AXIS_WIDTH:]) == {"⣿"}, row


def test_ramp_rises_left_to_right() -> None:
    series = [ChartSeries("allocated", ramp(), "cyan", fill=True)]
    text = render_chart(series, width=46, height=6, t_start=0, t_end=99).plain
    plot = lines(text)[:-1]
    top_row = plot[0][AXIS_WIDTH:]
    bottom_row = plot[-1][AXIS_WIDTH:]
    assert top_row[0] == " " and top_row[-1] != " "
    assert bottom_row[-1] == "⣿"
    assert all(ord(c) in BRAILLE or c == " " for row in plot for c in row[AXIS_WIDTH:])


def test_two_series_use_their_own_colours() -> None:
    allocated = [(float(t), 1.0 * GiB) for t in range(11)]
    reserved = [(float(t), 4.0 * GiB) for t in range(11)]
    series = [
        ChartSeries("allocated", allocated, "cyan", fill=True),
        ChartSeries("reserved", reserved, "magenta"),
    ]
    text = render_chart(series, width=26, height=5, t_start=0, t_end=10)
    styles = {str(span.style) for span in text.spans}
    assert {"cyan", "magenta"} <= styles
    rows = lines(text.plain)
    # Reserved is a line along the top; allocated fills the bottom quarter.
    assert set(rows[0][AXIS_WIDTH:]) == {"⠉"}
    assert set(rows[3][AXIS_WIDTH:]) == {"⣿"}
    assert rows[1][AXIS_WIDTH:].strip() == ""


def test_points_outside_the_window_are_not_drawn() -> None:
    series = [ChartSeries("allocated", [(-10.0, GiB), (-5.0, GiB)], "cyan", fill=True)]
    text = render_chart(series, width=30, height=4, t_start=0, t_end=10, y_max=GiB).plain
    assert plot_cells(text).strip() == ""


def test_phase_row_labels_each_span() -> None:
    spans = [ChartSpan("repeat", 0.0, 49.0), ChartSpan("broadcast", 50.0, 99.0)]
    rows = lines(
        render_chart([], width=AXIS_WIDTH + 60, height=4, t_start=0, t_end=100, spans=spans).plain
    )
    phase_row = rows[-1][AXIS_WIDTH:]
    assert phase_row.startswith("├─repeat─")
    assert "├─broadcast─" in phase_row
    assert phase_row.count("┤") == 2


def test_phase_row_clips_spans_at_the_window_edges_and_marks() -> None:
    spans = [ChartSpan("warmup", None, 20.0), ChartSpan("train", 50.0, None)]
    marks = [ChartMark(30.0, "checkpoint")]
    rows = lines(
        render_chart(
            [], width=AXIS_WIDTH + 40, height=3, t_start=0, t_end=100, spans=spans, marks=marks
        ).plain
    )
    phase_row = rows[-1][AXIS_WIDTH:]
    # Clipped on the left: no opening bracket; still running: no closing bracket.
    assert phase_row.startswith("─warmup─┤")
    assert "├─train" in phase_row and phase_row.endswith("─")
    assert phase_row[12] == "◆"


def test_long_phase_labels_are_cut_to_fit() -> None:
    spans = [ChartSpan("a-very-long-phase-name", 0.0, 10.0)]
    rows = lines(
        render_chart([], width=AXIS_WIDTH + 50, height=2, t_start=0, t_end=100, spans=spans).plain
    )
    segment = rows[-1][AXIS_WIDTH:].rstrip()
    assert segment.startswith("├─a-") and segment.endswith("…┤")
    assert len(segment) == 6


def test_a_tall_chart_labels_the_middle_of_the_axis() -> None:
    series = [ChartSeries("allocated", [(0.0, 8.0 * GiB), (1.0, 8.0 * GiB)], "cyan")]
    rows = lines(render_chart(series, width=40, height=9, t_start=0, t_end=1).plain)
    labels = [row[: AXIS_WIDTH - 1].strip() for row in rows[:-1]]
    assert labels == ["8.0G", "", "", "", "4.0G", "", "", "0"]
