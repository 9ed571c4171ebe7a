"""Rule-aware planner: a placement planned for the dispatch rule the engine applies.

Legend: L = MoE layers, E = logical experts, G = GPUs, N = nodes, S = slots per GPU,
P = G x S slots, U = units (nodes when N > 1, else GPUs).

Why: a placement fixes where replicas are; the engine's dispatch rule fixes what share of an
expert's tokens each replica takes. Planners that assume an even split are scored on shares
the engine does not apply: under SGLang's `static` dispatch (eplb.dispatch.sglang) a replica
takes (ranks mapped to it) / G of its expert's tokens, and which ranks map to it depends on
where its siblings are and on a seeded draw. This planner plans with the shares the rule
will really give, for rules whose shares stay fixed once each replicated expert's *units*
are fixed (`SCOPES`):
- "free" (even split: vLLM, TensorRT-LLM, SGLang after a rebalance with `dynamic`): shares
  are 1 / replicas whatever the GPUs, so this is `greedy` (one window) or `robust` (several).
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

from eplb.core.placement import Placement
from eplb.core.topology import Topology
from eplb.dispatch.rules import EvenSplit, PlanWeights
from eplb.dispatch.sglang import SglangDynamic, SglangStatic
from eplb.errors import EplbError, finite_number, positive_number, whole_number
from eplb.stats.loads import replica_counts_minmax
from planners.api import PlanRequest, Solution
from planners.greedy import plan_greedy
from planners.robust import RobustPlanner, normalise_windows, parse_blends, robust_demand, smooth_max_swaps
from planners.rule_previous import fit_gpus, held_by_gpu, match_units, moves_per_layer

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


def _assign_units(demand_LE: np.ndarray, count_LE: np.ndarray, num_units: int, unit_slots: int) -> np.ndarray:
    """Step 2: the units of every replicated expert's replicas, int [L, E, U] (1 = a replica there)."""
    L, E = demand_LE.shape
    U = num_units
    units_LEU = np.zeros((L, E, U), dtype=np.int64)
    for l in range(L):
        per_E = demand_LE[l] / count_LE[l]
        unit_load = np.zeros(U)
        free = np.full(U, unit_slots)
        for e in np.argsort(-per_E, kind="stable"):
            r = int(count_LE[l, e])
            if r < 2:
                continue
            # The r least-loaded units with a free slot; ties to the lower unit id.
            units = np.lexsort((np.arange(U), np.where(free > 0, unit_load, np.inf)))[:r]
            assert (free[units] > 0).all()
            unit_load[units] += per_E[e]
            free[units] -= 1
            units_LEU[l, e, units] = 1
    return units_LEU


def _provisional(count_LE: np.ndarray, units_LEU: np.ndarray, topology: Topology) -> np.ndarray:
    """Step 3's layout: replicated experts in their units, single replicas in the slots left."""
    L, E, U = units_LEU.shape
    P = topology.num_slots
    per_unit = P // U
    phy2log_LP = np.full((L, P), -1, dtype=np.int64)
    for l in range(L):
        for u in range(U):
            experts = np.flatnonzero(units_LEU[l, :, u])
            phy2log_LP[l, u * per_unit:u * per_unit + len(experts)] = experts
        free = np.flatnonzero(phy2log_LP[l] < 0)
        phy2log_LP[l, free] = np.flatnonzero(count_LE[l] == 1)
    return phy2log_LP


def _share_table(provisional_LP: np.ndarray, share_LP: np.ndarray, num_units: int, num_logical_experts: int):
    """Share of (layer, expert, unit) from the bound layout, float [L, E, U] (1 where unused)."""
    L, P = provisional_LP.shape
    table_LEU = np.ones((L, num_logical_experts, num_units))
    rows = np.broadcast_to(np.arange(L)[:, None], (L, P))
    unit_LP = np.broadcast_to(np.arange(P) // (P // num_units), (L, P))
    table_LEU[rows, provisional_LP, unit_LP] = share_LP
    return table_LEU


def _pack(share_TLE, count_LE, units_LEU, table_LEU, topology: Topology,
          held_LGE: np.ndarray | None = None, cap_L: np.ndarray | None = None):
    """Step 4: vector packing with unit constraints; returns (phy2log_LP, bound_LP), bound_LP
    True where a slot holds a replicated expert's replica.

    Heaviest replica first (largest load over the windows), each onto the allowed GPU with a
    free slot whose worst-window load after it is lowest (plus 1e-12 of its total load; the
    first such GPU on a tie). A replicated expert's replica is allowed its unit's GPUs; a
    single replica any unit with a free slot left after the replicated experts still to come
    to it. With held_LGE (bool [L, G, E], what the served placement holds) and cap_L, a
    replica goes to a GPU that holds its expert already when that GPU's worst-window load
    after it stays within cap_L[l] (it is then not copied). Every layer has P replicas, so
    the layers pack in lock-step: step i places each layer's i-th heaviest replica.
    """
    T, L, E = share_TLE.shape
    U = units_LEU.shape[2]
    G, S = topology.num_gpus, topology.slots_per_gpu
    Q = G // U  # GPUs per unit
    P = G * S
    w_LIT = np.empty((L, P, T))
    e_LI = np.empty((L, P), dtype=np.int64)
    u_LI = np.empty((L, P), dtype=np.int64)
    pending_LU = np.empty((L, U), dtype=np.int64)
    for l in range(L):
        item_e, item_u, w_IT, pending_LU[l] = _items(share_TLE, count_LE, units_LEU, table_LEU, l)
        order = _heaviest_first(item_u, w_IT)
        w_LIT[l], e_LI[l], u_LI[l] = w_IT[order], item_e[order], item_u[order]
    rows_L = np.arange(L)
    unit_G = np.arange(G) // Q
    phy2log_LP = np.empty((L, P), dtype=np.int64)
    bound_LP = np.zeros((L, P), dtype=bool)
    load_LGT = np.zeros((L, G, T))
    fill_LG = np.zeros((L, G), dtype=np.int64)
    for i in range(P):
        e_L, u_L, w_LT = e_LI[:, i], u_LI[:, i], w_LIT[:, i]
        replicated_L = u_L >= 0
        pending_LU[rows_L[replicated_L], u_L[replicated_L]] -= 1
        room_LU = (S - fill_LG).reshape(L, U, Q).sum(axis=2) - pending_LU
        ok_LG = np.where(replicated_L[:, None], unit_G == u_L[:, None], np.repeat(room_LU > 0, Q, axis=1))
        ok_LG &= fill_LG < S
        cost_LG = (load_LGT + w_LT[:, None, :]).max(axis=2) + 1e-12 * load_LGT.sum(axis=2)
        if held_LGE is not None:
            kept_LG = ok_LG & held_LGE[rows_L, :, e_L] & (cost_LG <= cap_L[:, None])
            ok_LG = np.where(kept_LG.any(axis=1)[:, None], kept_LG, ok_LG)
        g_L = np.where(ok_LG, cost_LG, np.inf).argmin(axis=1)
        assert ok_LG[rows_L, g_L].all(), "packing ran out of slots"
        slot_L = g_L * S + fill_LG[rows_L, g_L]
        phy2log_LP[rows_L, slot_L] = e_L
        bound_LP[rows_L, slot_L] = replicated_L
        fill_LG[rows_L, g_L] += 1
        load_LGT[rows_L, g_L] += w_LT
    return phy2log_LP, bound_LP


def _items(share_TLE, count_LE, units_LEU, table_LEU, l: int):
    """Layer l's replicas to pack: (expert [I], unit [I] (-1: a single replica, any GPU), load
    per window [I, T] under the planned shares, replicated replicas still to come per unit [U])."""
    single_E = np.flatnonzero(count_LE[l] == 1)
    rep_e, rep_u = np.nonzero(units_LEU[l])
    item_e = np.r_[rep_e, single_E]
    item_u = np.r_[rep_u, np.full(len(single_E), -1)]
    share_I = np.where(item_u >= 0, table_LEU[l, item_e, np.maximum(item_u, 0)], 1.0)
    w_IT = share_TLE[:, l, item_e].T * share_I[:, None]
    return item_e, item_u, w_IT, np.bincount(rep_u, minlength=units_LEU.shape[2])


def _heaviest_first(item_u, w_IT) -> np.ndarray:
    """The packing order: heaviest worst window first, then heaviest total; among equals the
    replicated replicas, which have fewer GPUs to go to."""
    return np.lexsort((item_u < 0, -w_IT.sum(axis=1), -w_IT.max(axis=1)))


def slot_loads(phy2log_LP, share_TLE, table_LEU, num_units: int) -> np.ndarray:
    """Load of every slot in every window under the planned shares, float [L, P, T]."""
    L, P = phy2log_LP.shape
    unit_P = np.arange(P) // (P // num_units)
    share_LP = table_LEU[np.arange(L)[:, None], phy2log_LP, unit_P[None, :]]
    w_LET = np.moveaxis(share_TLE, 0, 2)
    return np.take_along_axis(w_LET, phy2log_LP[:, :, None], axis=1) * share_LP[:, :, None]


def refine_bound(phy2log_LP: np.ndarray, slot_load_LPT: np.ndarray, bound_LP: np.ndarray, num_gpus: int,
                 gpus_per_unit: int, *, beta: float, max_rounds: int, top_gpus: int = 2) -> None:
    """Step 5, in place on all three arrays: swaps that lower the smooth maximum of GPU loads
    over all windows (`planners.robust.smooth_max_swaps`), on per-slot loads (shares differ
    between replicas), with bound slots kept inside their unit of gpus_per_unit GPUs."""
    smooth_max_swaps(phy2log_LP, slot_load_LPT, num_gpus, beta=beta, max_rounds=max_rounds, top_gpus=top_gpus,
                     num_units=num_gpus // gpus_per_unit, bound_LP=bound_LP)


def _pack_refined(share_TLE, count_LE, units_LEU, table_LEU, topology: Topology, beta: float, refine_rounds: int,
                  held_LGE=None, cap_L=None):
    """Steps 4-5: (phy2log_LP, score_L), score_L the worst-window peak under the planned shares.

    With held_LGE the packing keeps replicas in place under cap_L, and only layers whose peak
    exceeds the cap are refined (a swap search would move replicas for a gain within the cap).
    """
    T, L, _ = share_TLE.shape
    U = units_LEU.shape[2]
    G, S = topology.num_gpus, topology.slots_per_gpu
    phy2log_LP, bound_LP = _pack(share_TLE, count_LE, units_LEU, table_LEU, topology, held_LGE, cap_L)
    slot_LPT = slot_loads(phy2log_LP, share_TLE, table_LEU, U)
    score_L = slot_LPT.reshape(L, G, S, T).sum(axis=2).max(axis=(1, 2))
    layers = np.arange(L) if cap_L is None else np.flatnonzero(score_L > cap_L)
    if refine_rounds and layers.size:
        phy, slot, bound = phy2log_LP[layers], slot_LPT[layers], bound_LP[layers]
        refine_bound(phy, slot, bound, G, G // U, beta=beta, max_rounds=refine_rounds)
        phy2log_LP[layers], slot_LPT[layers] = phy, slot
        score_L = slot_LPT.reshape(L, G, S, T).sum(axis=2).max(axis=(1, 2))
    return phy2log_LP, score_L


def _layout(share_TLE, count_LE, units_LEU, rule, topology: Topology, layer_ids, beta: float,
            refine_rounds: int, held_LGE=None, move_slack: float = 0.0):
    """Steps 3-5 for one choice of counts and units: (phy2log_LP, table_LEU, score_L).

    With held_LGE (bool [L, G, E], the served placement): also a packing that keeps replicas
    where they are, taken in each layer whose peak stays within move_slack (in mean GPU
    loads) of the plain packing's, then the GPUs of each unit renamed to keep the most.
    """
    T, L, E = share_TLE.shape
    U = units_LEU.shape[2]
    provisional_LP = _provisional(count_LE, units_LEU, topology)
    share_LP = rule.bind(Placement(provisional_LP, topology.num_gpus, E, topology.num_nodes, layer_ids))(None)
    table_LEU = _share_table(provisional_LP, share_LP, U, E)
    phy2log_LP, score_L = _pack_refined(share_TLE, count_LE, units_LEU, table_LEU, topology, beta, refine_rounds)
    if held_LGE is not None:
        cap_L = score_L + move_slack
        kept_LP, kept_L = _pack_refined(share_TLE, count_LE, units_LEU, table_LEU, topology, beta, refine_rounds,
                                        held_LGE, cap_L)
        take_L = kept_L <= cap_L
        phy2log_LP = fit_gpus(np.where(take_L[:, None], kept_LP, phy2log_LP), held_LGE, U)
        score_L = np.where(take_L, kept_L, score_L)
    return phy2log_LP, table_LEU, score_L


def plan_for_rule(history_TLE: np.ndarray, topology: Topology, rule, *,
                  blends=(0.0, 1.0), beta: float = 50.0, refine_rounds: int = 200,
                  layer_ids=None, previous_LP: np.ndarray | None = None,
                  move_slack: float = 0.002) -> tuple[np.ndarray, dict]:
    """The whole plan for `rule` on `topology` against every window of history [T, L, E]: (phy2log_LP, info).

    previous_LP: the placement served now, int [L, P] (-1: empty slot), or None. With it the
    plan keeps replicas in place where that costs the shares nothing (planners.rule_previous)
    or at most move_slack of a layer's peak (in mean GPU loads).
    """
    history_TLE = np.asarray(history_TLE, dtype=np.float64)
    T, L, E = history_TLE.shape
    G, N, P = topology.num_gpus, topology.num_nodes, topology.num_slots
    scope = scope_of(rule)
    if scope != "unit":
        raise EplbError(f"plan_for_rule plans for rules whose shares follow the layout; {rule.name!r} splits "
                        f"evenly wherever the replicas are: plan with greedy or robust for it")
    U = N if N > 1 else G
    if P > U * E:
        raise EplbError(f"{P} slots need more than one replica of an expert per unit ({U} units, {E} experts): "
                        f"the rule-aware plan for {rule.name} keeps replicas of an expert on distinct "
                        f"{'nodes' if U == N else 'GPUs'}")
    held_LGE = None if previous_LP is None else held_by_gpu(np.asarray(previous_LP), G, E)
    share_TLE = normalise_windows(history_TLE, G)
    blends = (0.0,) if T == 1 else tuple(blends)
    fit = dict(beta=beta, refine_rounds=refine_rounds, held_LGE=held_LGE, move_slack=move_slack)
    tried = []
    for blend in blends:
        # Step 1: replicate (at most one replica per unit); Step 2: units (renamed to the served ones).
        demand_LE = robust_demand(share_TLE, blend)
        count_LE = replica_counts_minmax(demand_LE, P, max_replicas=U)
        units_LEU = _assign_units(demand_LE, count_LE, U, P // U)
        if held_LGE is not None:
            units_LEU = match_units(units_LEU, held_LGE)
        tried.append((count_LE, units_LEU, _layout(share_TLE, count_LE, units_LEU, rule, topology, layer_ids, **fit)))
    best_L = np.argmin(np.stack([t[2][2] for t in tried]), axis=0)
    phy2log_LP, table_LEU, score_L = tried[0][2]
    if len(tried) > 1:
        # Layers taken from different blends change the draws of the layers after them, so the
        # mixed layout is bound and packed once more.
        count_LE = np.stack([tried[b][0][l] for l, b in enumerate(best_L)])
        units_LEU = np.stack([tried[b][1][l] for l, b in enumerate(best_L)])
        phy2log_LP, table_LEU, score_L = _layout(share_TLE, count_LE, units_LEU, rule, topology, layer_ids, **fit)
    U = table_LEU.shape[2]
    planned_LP = table_LEU[np.arange(L)[:, None], phy2log_LP, (np.arange(P) // (P // U))[None, :]]
    served_LP = rule.bind(Placement(phy2log_LP, G, E, N, layer_ids))(None)
    info = {"scope": scope, "units": U, "windows": int(T),
            "served_matches_plan": bool(np.allclose(served_LP, planned_LP, atol=1e-12)),
            "history_peak_median": float(np.median(score_L)), "history_peak_max": float(np.max(score_L)),
            "blend_chosen": {str(b): int(np.sum(best_L == i)) for i, b in enumerate(blends)}}
    if held_LGE is not None:
        info["fitted_to_previous"] = {"moves": int(moves_per_layer(held_LGE, phy2log_LP).sum()),
                                      "move_slack": move_slack}
    return phy2log_LP, info


class RuleAwarePlanner:
    """Plans for the request's dispatch rule (`PlanRequest.dispatch`), against every window of
    the history (one window: the planning load).

    blends: demand blends for replica counts (0 = mean share over windows, 1 = max), best per layer.
    beta: sharpness of the smooth maximum in the swap search (loads in mean GPU loads).
    refine_rounds: rounds of swaps after packing (0 = off).
    move_slack: with a served placement (`PlanRequest.previous`), how much higher (in mean GPU
      loads, 0.002 = 0.2%) a layer's planned peak may be to keep replicas where they are.
    """

    name = "rule-aware"

    def __init__(self, blends: tuple | list | str = (0.0, 1.0), beta: float = 50.0, refine_rounds: int = 200,
                 move_slack: float = 0.002):
        self.blends = parse_blends(blends)
        # float() first: a setting given as text (--set beta=x) is "of the wrong type" (get_planner).
        self.beta = positive_number("beta", float(beta))
        self.refine_rounds = whole_number("refine_rounds", refine_rounds)
        self.move_slack = finite_number("move_slack", float(move_slack), 0)

    def plan(self, request: PlanRequest) -> Solution:
        t = request.topology
        rule = request.dispatch
        history = request.history_TLE if request.history_TLE is not None else request.load_LE[None]
        if scope_of(rule) == "free":
            # Shares are 1 / replicas wherever the replicas are: greedy for one window, robust for more.
            if len(history) == 1:
                phy2log_LP = plan_greedy(request.load_LE, t.num_gpus, t.slots_per_gpu, min(self.refine_rounds, 64))
                return Solution(phy2log_LP, message=f"planned for dispatch rule {rule.name} (greedy)",
                                info={"scope": "free", "dispatch": rule.name})
            sol = RobustPlanner(self.blends, beta=self.beta, refine_rounds=self.refine_rounds).plan(request)
            return Solution(sol.phy2log_LP, message=f"planned for dispatch rule {rule.name} (robust: {sol.message})",
                            info={**sol.info, "scope": "free", "dispatch": rule.name})
        phy2log_LP, info = plan_for_rule(history, t, rule,
                                         blends=self.blends, beta=self.beta, refine_rounds=self.refine_rounds,
                                         layer_ids=request.layer_ids, move_slack=self.move_slack,
                                         previous_LP=None if request.previous is None else request.previous.phy2log_LP)
        info["dispatch"] = rule.name
        return Solution(phy2log_LP, message=f"planned for dispatch rule {rule.name} against "
                                            f"{info.get('windows', 1)} window(s)", info=info)
