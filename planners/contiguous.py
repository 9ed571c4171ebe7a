"""Contiguous placement: the no-EPLB baseline every report compares against.

The placement itself is `eplb.core.placement.contiguous_map` (expert e on GPU e // (E / G), spare
slots repeating the GPU's own experts); this planner puts it behind the planner table.
"""

from __future__ import annotations

from eplb.core.placement import contiguous_map
from planners.api import PlanRequest, Solution


class ContiguousPlanner:
    """No load balancing: the baseline every report compares against."""

    name = "contiguous"

    one_replica_per_gpu = False
    """Spare slots repeat the GPU's own experts (see eplb.core.placement.contiguous_map)."""

    def plan(self, request: PlanRequest) -> Solution:
        return Solution(contiguous_map(request.num_logical_experts, request.topology, request.num_layers),
                        message="no load balancing (baseline)")
