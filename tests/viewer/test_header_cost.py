"""The header says what torchtop's agent costs the job."""

from __future__ import annotations

from tests.fakes.cost import agent_stats
from torchtop.model.job import JobModel
from torchtop.tui.widgets.header import agent_cost, header_rows


def test_the_header_shows_the_agents_share_of_step_time() -> None:
    model = JobModel()
    assert agent_cost(model) == ""
    model.apply(agent_stats(cpu_share=0.004, step_share=0.004))
    assert agent_cost(model) == "torchtop 0.4% of step"
    assert "torchtop 0.4% of step" in header_rows(model)[1][1].plain
    model.apply(agent_stats(cpu_share=0.002))
    assert agent_cost(model) == "torchtop 0.2% of a core"
    model.apply(agent_stats(cpu_share=None))
    assert agent_cost(model) == ""
