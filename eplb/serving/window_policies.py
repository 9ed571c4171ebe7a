"""The fixed rules an online policy is measured against: `WindowPolicy` ("window", the
Rebalancer's `window=N`: plan on the newest N windows at every decision) and `StaticPolicy`
("static": never rebalance).

Legend: L = MoE layers, E = logical experts, P = physical slots.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from eplb.core.placement import Placement
from eplb.dispatch.cost import TimeObjective, check_objective
from eplb.errors import finite_number, whole_number
from eplb.migration import Budget
from eplb.planning.front_door import plan
from eplb.serving.load_estimate import WindowMemory
from eplb.serving.policy_types import NO_BUDGET, Decision
from planners.api import get_planner


class WindowPolicy:
    """Plan on the sum of the newest `window` windows (None: every window seen) at each decision.

    planner: an eplb planner name; move_cost: the migration-aware plan's price per move
    (eplb.migration.Budget), 0.001 as the Rebalancer's default, added to a budget's own;
    objective: "tokens" or an eplb.dispatch.cost.TimeObjective, handed to `eplb.plan`.
    """

    name = "window"

    def __init__(self, window: int | None = 8, planner: str = "greedy", move_cost: float = 0.001,
                 objective: str | TimeObjective = "tokens"):
        if isinstance(window, str) and window.lower() in ("all", "none"):
            window = None
        self.window = None if window is None else whole_number("window (windows)", window, 1)
        get_planner(planner)
        self.planner = planner
        self.move_cost = finite_number("move_cost", move_cost, 0.0)
        self.objective = check_objective(objective)
        self._mem: WindowMemory | None = None
        self._total_LE: np.ndarray | None = None

    @property
    def memory_bytes(self) -> int:
        return (0 if self._mem is None else self._mem.nbytes) + (0 if self._total_LE is None else self._total_LE.nbytes)

    def observe(self, counts_LE: np.ndarray, placement: Placement) -> None:
        if self.window is None:
            self._total_LE = counts_LE.astype(np.float64) if self._total_LE is None else self._total_LE + counts_LE
            return
        if self._mem is None:
            self._mem = WindowMemory(self.window, *counts_LE.shape)
        self._mem.push(counts_LE)

    def decide(self, placement: Placement, budget: Budget | None = None, *,
               num_expert_groups: int | None = None) -> Decision | None:
        load_LE = self._total_LE if self.window is None else (None if self._mem is None else self._mem.total())
        if load_LE is None or load_LE.sum() <= 0:
            return None
        budget = NO_BUDGET if budget is None else budget
        # The planner's map only: PlanResult.placement would also score a contiguous baseline.
        res = plan(load_LE, topology=placement.topology, planner=self.planner, previous=placement,
                   budget=replace(budget, move_cost=budget.move_cost + self.move_cost),
                   num_expert_groups=num_expert_groups, objective=self.objective)
        new_LP = res.solution.phy2log_LP
        changed_L = (new_LP != placement.phy2log_LP).any(axis=1)
        if not changed_L.any():
            return None
        L = new_LP.shape[0]
        return Decision(new_LP, changed_L, np.zeros(L), np.zeros(L, dtype=bool),
                        f"{self.planner} on the last {self.window or 'all'} window(s)")


class StaticPolicy:
    """Never rebalance: the placement made before serving stays (the reference a policy must beat)."""

    name = "static"
    memory_bytes = 0

    def observe(self, counts_LE: np.ndarray, placement: Placement) -> None:
        return None

    def decide(self, placement: Placement, budget: Budget | None = None, *,
               num_expert_groups: int | None = None) -> Decision | None:
        return None
