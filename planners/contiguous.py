"""Contiguous placement: the no-EPLB baseline (expert e on GPU e // (E / G)).

Experts are split over GPUs in id order, as evenly as possible. A GPU's spare slots repeat
its own experts, which splits their tokens inside the GPU and so leaves every GPU's load
exactly as without redundancy: this is what a server does with no load balancing.
"""

from __future__ import annotations

import numpy as np

from eplb.errors import EplbError
from eplb.planning import PlanRequest, Solution, register
from eplb.topology import Topology


def contiguous_map(num_logical_experts: int, topo: Topology, num_layers: int) -> np.ndarray:
    """phy2log_LP of the contiguous placement, the same for every layer."""
    G, S = topo.num_gpus, topo.slots_per_gpu
    if num_logical_experts > G * S:
        raise EplbError(f"{G} GPUs x {S} slots cannot hold {num_logical_experts} experts")
    if num_logical_experts < G:
        raise EplbError(f"contiguous placement needs at least one expert per GPU: "
                        f"{num_logical_experts} experts < {G} GPUs")
    row = np.empty(G * S, dtype=np.int64)
    for g, experts in enumerate(np.array_split(np.arange(num_logical_experts), G)):
        row[g * S:(g + 1) * S] = np.resize(experts, S)  # spare slots cycle the GPU's own experts
    return np.tile(row, (num_layers, 1))


def contiguous_placement(like):
    """The no-EPLB baseline on the same GPUs, nodes, slots and layers as Placement `like`."""
    from eplb.placement import Placement

    topo = Topology(like.num_gpus, like.slots_per_gpu, like.num_nodes)
    return Placement(contiguous_map(like.num_logical_experts, topo, like.num_layers), like.num_gpus,
                     like.num_logical_experts, like.num_nodes, like.layer_ids, planner="contiguous")


@register("contiguous")
class ContiguousPlanner:
    """No load balancing: the baseline every report compares against."""

    one_replica_per_gpu = False
    """Spare slots repeat the GPU's own experts (see the module docstring)."""

    def plan(self, request: PlanRequest) -> Solution:
        return Solution(contiguous_map(request.num_logical_experts, request.topology, request.num_layers),
                        message="no load balancing (baseline)")
