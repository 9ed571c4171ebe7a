"""Rule-aware planner: a placement planned for the dispatch rule the engine applies.

Legend: L = MoE layers, E = logical experts, G = GPUs, N = nodes, S = slots per GPU,
P = G x S slots, U = units (nodes when N > 1, else GPUs).

Why: a placement fixes where replicas are; the engine's dispatch rule fixes what share of an
expert's tokens each replica takes. Planners that assume an even split are scored on shares
the engine does not apply: under SGLang's `static` dispatch (eplb.sglang_dispatch) a replica
takes (ranks mapped to it) / G of its expert's tokens, and which ranks map to it depends on
where its siblings are and on a seeded draw. This planner plans with the shares the rule
will really give, for rules whose shares stay fixed once each replicated expert's *units*
are fixed (`SCOPES`):
- "free" (even split: vLLM, TensorRT-LLM, SGLang after a rebalance with `dynamic`): shares
  are 1 / replicas whatever the GPUs, so this is greedy packing plus swaps.
- "unit" (SGLang `static` and `dynamic`): with at most one replica of an expert per node,
  a rank on a node with a replica sends its tokens there (or to its own copy), and only
  ranks on nodes without one draw; which ranks draw, and so every draw, depends only on
  which nodes hold which replicated experts. On one node the units are GPUs (every rank
  without a copy draws, so the holders must be fixed before the draw).

Step 1: replicate: replica counts minimising the heaviest replica (even split), at most U
        replicas per expert (one per unit).
Step 2: give each replicated expert's replicas distinct units, heaviest first to the
        least-loaded units (expected shares 1 / replicas), for every layer.
Step 3: bind the rule to that layout (any GPU inside each unit, single replicas anywhere)
        to get the shares the engine will really serve: they hold for any packing below.
Step 4: pack per layer, heaviest first, each replica onto the least-loaded GPU allowed to
        it (its unit for replicated experts, any for the rest) with a free slot.
Step 5: swap pairs of replicas between the busiest GPU and another to lower it, as long as
        the swap keeps every replicated expert in its unit (`refine_rounds` rounds).
The final placement is bound to the rule once more and its shares compared with the ones
planned for (Solution.info["served_matches_plan"]).
"""

from __future__ import annotations

import numpy as np

from eplb.dispatch import EvenSplit, PlanWeights, get_rule
from eplb.errors import EplbError
from eplb.placement import Placement
from eplb.planning import PlanRequest, Solution, register, whole_setting
from eplb.sglang_dispatch import SglangDynamic, SglangStatic
from eplb.stats import replica_counts_minmax
from planners.greedy import plan_greedy

SCOPES: dict[type, str] = {EvenSplit: "free", PlanWeights: "free", SglangStatic: "unit", SglangDynamic: "unit"}
"""Rule type -> how far its shares depend on the layout (see the module text)."""


def scope_of(rule) -> str:
    """"free" or "unit" for a rule this planner can plan for; EplbError naming the others."""
    scope = SCOPES.get(type(rule))
    if scope is None:
        names = ", ".join(sorted({t.name for t in SCOPES}))
        raise EplbError(f"the rule-aware planner plans for static rules ({names}), not {rule.name!r}: "
                        f"per-batch rules re-split every batch, so plan with greedy for them")
    return scope


def _assign_units(load_LE: np.ndarray, count_LE: np.ndarray, num_units: int, unit_slots: int) -> list[list[tuple]]:
    """Step 2: per layer, (expert, unit) for every replica of a replicated expert."""
    L, E = load_LE.shape
    out: list[list[tuple]] = []
    for l in range(L):
        per_E = load_LE[l] / count_LE[l]
        unit_load = np.zeros(num_units)
        free = np.full(num_units, unit_slots)
        layer: list[tuple] = []
        for e in np.argsort(-per_E, kind="stable"):
            r = int(count_LE[l, e])
            if r < 2:
                continue
            # Least-loaded units with a free slot; ties to the lower unit id.
            units = np.lexsort((np.arange(num_units), np.where(free > 0, unit_load, np.inf)))[:r]
            assert (free[units] > 0).all()
            unit_load[units] += per_E[e]
            free[units] -= 1
            layer.extend((int(e), int(u)) for u in units)
        out.append(layer)
    return out


def _provisional(count_LE: np.ndarray, units: list[list[tuple]], G: int, S: int, U: int) -> np.ndarray:
    """Step 3's layout: replicated experts in their units, single replicas in the slots left."""
    L, E = count_LE.shape
    per_unit = G * S // U
    phy2log_LP = np.full((L, G * S), -1, dtype=np.int64)
    for l in range(L):
        fill = np.zeros(U, dtype=np.int64)
        for e, u in units[l]:
            phy2log_LP[l, u * per_unit + fill[u]] = e
            fill[u] += 1
        free = np.flatnonzero(phy2log_LP[l] < 0)
        phy2log_LP[l, free] = np.flatnonzero(count_LE[l] == 1)
    return phy2log_LP


def _pack(load_LE, count_LE, units, share_LP, provisional_LP, G: int, S: int, U: int) -> tuple[np.ndarray, np.ndarray]:
    """Step 4: heaviest-first packing with unit constraints; returns (phy2log_LP, unit_bound_LP)."""
    L, E = load_LE.shape
    P = G * S
    gpus_per_unit = G // U
    phy2log_LP = np.empty((L, P), dtype=np.int64)
    bound_LP = np.zeros((L, P), dtype=bool)
    for l in range(L):
        # Items: one per slot of the provisional layout, with the load the rule gives it.
        item_e = provisional_LP[l]
        item_w = load_LE[l, item_e] * share_LP[l]
        item_unit = np.where(count_LE[l, item_e] > 1, np.arange(P) // (P // U), -1)
        pending_U = np.bincount(item_unit[item_unit >= 0], minlength=U)
        gpu_load = np.zeros(G)
        gpu_fill = np.zeros(G, dtype=np.int64)
        # Constrained items first among equals: a unit's slots are reserved for its replicas.
        for i in np.lexsort((item_unit < 0, -item_w)):
            u = item_unit[i]
            if u >= 0:
                ok = np.zeros(G, dtype=bool)
                ok[u * gpus_per_unit:(u + 1) * gpus_per_unit] = True
                pending_U[u] -= 1
            else:
                unit_free = (np.add.reduceat(S - gpu_fill, np.arange(0, G, gpus_per_unit)) - pending_U)
                ok = np.repeat(unit_free > 0, gpus_per_unit)
            ok &= gpu_fill < S
            g = int(np.argmin(np.where(ok, gpu_load, np.inf)))
            assert ok[g], "packing ran out of slots"
            slot = g * S + gpu_fill[g]
            phy2log_LP[l, slot] = item_e[i]
            bound_LP[l, slot] = u >= 0
            gpu_fill[g] += 1
            gpu_load[g] += item_w[i]
    return phy2log_LP, bound_LP


def refine_bound(phy2log_LP: np.ndarray, slot_load_LP: np.ndarray, bound_LP: np.ndarray, num_gpus: int,
                 gpus_per_unit: int, max_rounds: int) -> None:
    """Step 5, in place on all three arrays: swaps that lower each layer's busiest GPU.

    A slot with bound_LP set may only move inside its unit (gpus_per_unit consecutive GPUs);
    a swap never puts two replicas of one expert on one GPU.
    """
    L, P = phy2log_LP.shape
    G = num_gpus
    S = P // G
    gpu_of_b = np.arange(P) // S
    active = np.arange(L)
    for _ in range(max_rounds):
        if active.size == 0:
            break
        A = active.size
        ar = np.arange(A)
        phy = phy2log_LP[active]
        w_AP = slot_load_LP[active]
        bnd = bound_LP[active]
        gl_AG = w_AP.reshape(A, G, S).sum(axis=2)
        top = np.argmax(gl_AG, axis=1)
        top_load = gl_AG[ar, top]
        a_slots = top[:, None] * S + np.arange(S)                       # [A, S]
        wa_AS = np.take_along_axis(w_AP, a_slots, axis=1)
        ea_AS = np.take_along_axis(phy, a_slots, axis=1)
        ba_AS = np.take_along_axis(bnd, a_slots, axis=1)
        delta = wa_AS[:, :, None] - w_AP[:, None, :]                    # load moved from top to b's GPU
        new_max = np.maximum(top_load[:, None, None] - delta, gl_AG[:, gpu_of_b][:, None, :] + delta)
        phy_AGS = phy.reshape(A, G, S)
        e_b_on_top = (phy_AGS[ar, top][:, :, None] == phy[:, None, :]).any(axis=1)        # [A, P]
        e_a_on_h = (phy_AGS[:, None, :, :] == ea_AS[:, :, None, None]).any(axis=3)[:, :, gpu_of_b]  # [A, S, P]
        same_unit = (gpu_of_b[None, :] // gpus_per_unit) == (top[:, None] // gpus_per_unit)         # [A, P]
        movable = (~ba_AS[:, :, None] & ~bnd[:, None, :]) | same_unit[:, None, :]
        bad = (gpu_of_b[None, None, :] == top[:, None, None]) | e_b_on_top[:, None, :] | e_a_on_h | ~movable
        gain = np.where(bad, -np.inf, top_load[:, None, None] - new_max)
        flat = gain.reshape(A, -1).argmax(axis=1)
        best = gain.reshape(A, -1)[ar, flat]
        improve = best > 1e-9 * np.maximum(top_load, 1.0)
        if not improve.any():
            break
        s_a, b = np.divmod(flat[improve], P)
        layers = active[improve]
        a = top[improve] * S + s_a
        for arr in (phy2log_LP, slot_load_LP, bound_LP):
            tmp = arr[layers, a].copy()
            arr[layers, a] = arr[layers, b]
            arr[layers, b] = tmp
        active = layers


def plan_for_rule(load_LE: np.ndarray, num_gpus: int, num_nodes: int, slots_per_gpu: int, rule,
                  refine_rounds: int = 64, layer_ids=None) -> tuple[np.ndarray, dict]:
    """The whole plan for `rule`: (phy2log_LP, info). Shapes as in the module legend."""
    load_LE = np.asarray(load_LE, dtype=np.float64)
    L, E = load_LE.shape
    G, N, S = num_gpus, num_nodes, slots_per_gpu
    P = G * S
    scope = scope_of(rule)
    if scope == "free":
        return plan_greedy(load_LE, G, S, refine_rounds), {"scope": scope}
    U = N if N > 1 else G
    if P > U * E:
        raise EplbError(f"{P} slots need more than one replica of an expert per unit ({U} units, {E} experts): "
                        f"the rule-aware plan for {rule.name} keeps replicas of an expert on distinct "
                        f"{'nodes' if N > 1 else 'GPUs'}")
    # Step 1: replicate, at most one replica per unit.
    count_LE = replica_counts_minmax(load_LE, P, max_replicas=U)
    # Step 2: units for replicated experts.
    units = _assign_units(load_LE, count_LE, U, P // U)
    # Step 3: the shares the rule gives this layout.
    provisional_LP = _provisional(count_LE, units, G, S, U)
    layout = Placement(provisional_LP, G, E, N, layer_ids)
    share_LP = rule.bind(layout)(None)
    # Step 4: pack; Step 5: swaps.
    phy2log_LP, bound_LP = _pack(load_LE, count_LE, units, share_LP, provisional_LP, G, S, U)
    # Shares follow the replica: replicated ones by (expert, unit), single ones are 1.
    planned_LP = _shares_for(phy2log_LP, provisional_LP, share_LP, count_LE, G // U, S)
    slot_load_LP = np.take_along_axis(load_LE, phy2log_LP, axis=1) * planned_LP
    if refine_rounds:
        refine_bound(phy2log_LP, slot_load_LP, bound_LP, G, G // U, refine_rounds)
        planned_LP = _shares_for(phy2log_LP, provisional_LP, share_LP, count_LE, G // U, S)
    served_LP = rule.bind(Placement(phy2log_LP, G, E, N, layer_ids))(None)
    matches = bool(np.allclose(served_LP, planned_LP, atol=1e-12))
    return phy2log_LP, {"scope": scope, "units": U, "served_matches_plan": matches,
                        "replicated_experts_median": float(np.median((count_LE > 1).sum(axis=1)))}


def _shares_for(phy2log_LP, provisional_LP, share_LP, count_LE, gpus_per_unit: int, S: int) -> np.ndarray:
    """The planned share of every slot of phy2log_LP, looked up by (layer, expert, unit)."""
    L, P = phy2log_LP.shape
    E = count_LE.shape[1]
    unit_P = np.arange(P) // (gpus_per_unit * S)
    U = int(unit_P.max()) + 1
    table_LEU = np.ones((L, E, U))
    rows = np.broadcast_to(np.arange(L)[:, None], (L, P))
    table_LEU[rows, provisional_LP, np.broadcast_to(unit_P, (L, P))] = share_LP
    return table_LEU[rows, phy2log_LP, np.broadcast_to(unit_P, (L, P))]


@register("rule-aware")
class RuleAwarePlanner:
    """Plans for the request's dispatch rule (`PlanRequest.dispatch`; even split without one).

    refine_rounds: rounds of busiest-GPU swaps after packing (0 = off).
    """

    def __init__(self, refine_rounds: int = 64):
        self.refine_rounds = whole_setting("refine_rounds", refine_rounds)

    def plan(self, request: PlanRequest) -> Solution:
        t = request.topology
        rule = get_rule("even" if request.dispatch is None else request.dispatch)
        phy2log_LP, info = plan_for_rule(request.load_LE, t.num_gpus, t.num_nodes, t.slots_per_gpu, rule,
                                         self.refine_rounds, request.layer_ids)
        info["dispatch"] = rule.name
        return Solution(phy2log_LP, message=f"planned for dispatch rule {rule.name}", info=info)
