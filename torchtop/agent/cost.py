"""The agent's own cost, measured in the job, and the budget that slows its sampler.

Every second the sampler asks :class:`CostMeter` how much CPU the agent's threads used since
the last time: as a share of one core, and, while the job takes steps, of its training time (a
job whose step holds the GIL loses about that much of each step to the agent). Above the budget
for :data:`OVER_BUDGET_S` seconds in a row, the sampler's interval doubles, up to
:data:`MAX_INTERVAL_S`; the first slowdown is said once, in the job's stderr and to viewers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from torchtop.agent.threads import agent_cpu_s

#: Seconds above the budget before the sampler slows down (again).
OVER_BUDGET_S = 2
#: The slowest the budget makes the sampler (viewers call an agent silent after 3 s).
MAX_INTERVAL_S = 1.0


@dataclass(frozen=True)
class Cost:
    """One reading: the agent's CPU so far and its shares over the last interval."""

    cpu_s: float | None
    cpu_share: float | None
    step_share: float | None
    #: The step share the budget weighs: without the op windows' reading, which their own
    #: budget (``--ops-budget``) already paces. ``None`` while the job takes no steps.
    budgeted_share: float | None = None


class CostMeter:
    """Measures the agent's threads' CPU against wall time and the job's steps."""

    def __init__(
        self,
        budget: float,
        steps_total: Callable[[], int],
        cpu_s: Callable[[], float | None] = agent_cpu_s,
        clock: Callable[[], float] = time.monotonic,
        exempt_s: Callable[[], float] = lambda: 0.0,
    ) -> None:
        """``exempt_s``: seconds so far of the agent's work another budget pays for (the op
        windows' reading); counted in the shares shown, not in the one this budget weighs."""
        self.budget = budget
        self._steps_total = steps_total
        self._cpu_s = cpu_s
        self._clock = clock
        self._exempt_s = exempt_s
        self._last: tuple[float, float, int, float] | None = None
        self._over = 0
        self.slowdowns = 0

    def read(self) -> Cost:
        """The cost since the previous reading (the shares are ``None`` on the first)."""
        cpu = self._cpu_s()
        now = self._clock()
        try:
            steps = self._steps_total()
        except Exception:
            steps = 0
        if cpu is None:
            return Cost(None, None, None)
        exempt = self._exempt_s()
        last, self._last = self._last, (now, cpu, steps, exempt)
        if last is None or now <= last[0]:
            return Cost(cpu, None, None)
        wall = now - last[0]
        share = max(0.0, cpu - last[1]) / wall
        if steps <= last[2]:
            return Cost(cpu, share, None)
        # While the job steps, the agent's CPU time comes out of its training time.
        budgeted = max(0.0, cpu - last[1] - (exempt - last[3])) / wall
        return Cost(cpu, share, share, budgeted)

    def over_budget(self, cost: Cost) -> bool:
        """True when the sampler should slow down now: ``cost`` is the latest reading, above
        the budget for :data:`OVER_BUDGET_S` readings in a row."""
        share = cost.budgeted_share
        if self.budget <= 0 or share is None or share <= self.budget:
            self._over = 0
            return False
        self._over += 1
        if self._over < OVER_BUDGET_S:
            return False
        self._over = 0
        self.slowdowns += 1
        return True
