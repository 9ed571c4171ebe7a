"""The front door: `plan(loads, topology=..., planner=...) -> PlanResult` (`front_door`)."""

from eplb.planning.front_door import (
    PlanResult,
    as_history,
    even_split,
    lower_bound,
    plan,
    plan_for_resplit,
    resplit_windows,
    score,
    size_topology,
)

__all__ = [
    "PlanResult",
    "as_history",
    "even_split",
    "lower_bound",
    "plan",
    "plan_for_resplit",
    "resplit_windows",
    "score",
    "size_topology",
]
