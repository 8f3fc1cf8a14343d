"""The Advice panel: the header's one-line summary, ``a`` opens the findings with their
evidence, fix and demo, and the panel follows the model as findings come and clear."""

from __future__ import annotations

from fakes.source import FakeSource
from test_advice import input_job
from test_tui_app import SIZE, T0, drained, header_text, hello, pilot_test, static_text
from textual.widgets import Static

from torchtop.tui.app import TorchtopApp
from torchtop.tui.screens.advice import AdviceScreen


@pilot_test
async def test_the_header_counts_findings_and_a_shows_them_with_evidence() -> None:
    source = FakeSource([hello(cuda=False), *input_job(0.5, 10)])
    app = TorchtopApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        assert "1 critical (a)" in header_text(app)
        await pilot.press("a")
        await pilot.pause()
        assert isinstance(app.screen, AdviceScreen)
        text = static_text(app.screen.query_one("#advice-text", Static))
        assert "CRITICAL Input-bound" in text
        assert "data wait 50% of step time" in text and "num_workers=0" in text
        assert "torchtop demo dataloader" in text

        source.deliver(input_job(0.0, 15, T0 + 10))  # the fix: the finding clears
        await drained(pilot)
        text = static_text(app.screen.query_one("#advice-text", Static))
        assert "No findings" in text and "cleared" in text
        await pilot.press("a")
        await pilot.pause()
        assert not isinstance(app.screen, AdviceScreen)
        assert "(a)" not in header_text(app)


@pilot_test
async def test_a_healthy_job_says_so_at_80_by_24() -> None:
    app = TorchtopApp(FakeSource([hello(cuda=False), *input_job(0.0, 10)]))
    async with app.run_test(size=(80, 24)) as pilot:
        await drained(pilot)
        assert "(a)" not in header_text(app)
        await pilot.press("a")
        await pilot.pause()
        text = static_text(app.screen.query_one("#advice-text", Static))
        assert "No findings" in text
