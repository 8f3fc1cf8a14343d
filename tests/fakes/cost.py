"""An agent's account of its own cost, as it sends it once a second."""

from __future__ import annotations

from torchtop.protocol import AgentStats


def agent_stats(
    t: float = 1.0,
    cpu_s: float | None = 0.5,
    cpu_share: float | None = 0.002,
    step_share: float | None = None,
) -> AgentStats:
    return AgentStats(
        t=t,
        clients=1,
        queued_bytes=0,
        dropped=0,
        ticks=10,
        late_ticks=0,
        mean_tick_s=0.001,
        max_tick_s=0.002,
        cpu_s=cpu_s,
        cpu_share=cpu_share,
        step_share=step_share,
        cost_budget=0.01,
        interval_s=0.1,
    )
