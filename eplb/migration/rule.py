"""Migration under a dispatch rule whose shares depend on the layout (SGLang's `static`, `dynamic`).

Legend: L = MoE layers, E = logical experts, G = GPUs, N = nodes, S = slots per GPU,
P = G x S slots, C = candidate placements.

Why: relabelling a plan (renaming its nodes and GPUs) keeps an even split's balance, but not
SGLang's: which ranks draw, and what they draw, follow the nodes and slot order of every
replica (eplb.dispatch.sglang), so a renamed plan is served with other shares than it was
packed for; and the budgeted search prices even splits. Here every candidate is a whole
placement judged by binding the rule to it, which is exact:
- "planned": the planner's plan, only its slots inside each GPU reordered to their old slots
  (the rule sees GPUs, not slots inside one: the GPU loads are unchanged). The rule-aware
  planner fits its plan to the served placement itself (planners.rule_previous).
- "relabel": the plan with its nodes and GPUs renamed (`relabel`), which the rule may serve
  better or worse.
With a budget (`Budget.limited`) also:
- "previous": the served placement kept (experts lost with failed ranks restored);
- "budgeted_search": the even-split search from it (`budgeted_search`);
- "repair": swaps on the served placement that leave every share of the rule as it is
  (`repair_swaps`), so their gains are exact, bought within the budget; and the same swaps
  after the search ("budgeted_search+repair").
With a budget no candidate may serve a layer worse than keeping the served placement: the
layers where one does are put back as served and the candidate bound again (a layer put
back changes the draws of the layers after it), until none is worse (`_no_layer_worse`).
Each candidate that fits the budget costs the sum over layers of its busiest GPU's load
under the rule plus the move price (`Budget.move_cost` x the layer's mean GPU load per move,
and the span price of `Budget.span_cost`); the cheapest wins, fewer moves on a tie.
"previous" is always a candidate, so with a budget the result never serves any layer worse
than keeping the served placement does.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from eplb.core.placement import Placement, gpu_loads
from eplb.core.topology import Topology
from eplb.dispatch.sglang import SglangDynamic, SglangStatic
from eplb.migration.moves import count_moves, keep_slots, relabel
from eplb.migration.search import Budget, budgeted_search, span_priced
from eplb.stats.loads import group_span

LAYOUT_RULES = (SglangStatic, SglangDynamic)
"""Rule types whose shares depend on where replicas are, not only on how many there are."""


def layout_dependent(rule) -> bool:
    """True for rules whose shares depend on where replicas are (SGLang's), not only on counts."""
    return isinstance(rule, LAYOUT_RULES)


def served_peaks(rule, phy2log_LP: np.ndarray, load_LE: np.ndarray, topology: Topology,
                 layer_ids) -> tuple[np.ndarray, np.ndarray]:
    """(busiest GPU's load per layer [L], the rule's shares [L, P]) of a full placement."""
    G = topology.num_gpus
    pl = Placement(phy2log_LP, G, load_LE.shape[1], topology.num_nodes, layer_ids)
    w_LP = rule.bind(pl)(load_LE)
    return gpu_loads(phy2log_LP, load_LE, G, w_LP).max(axis=1), w_LP


def _movable(phy2log_LP: np.ndarray, topology: Topology) -> np.ndarray:
    """How far each slot's replica may move without changing any share, int8 [L, P].

    2: anywhere (its expert's only replica: every rank sends it there whatever the GPU);
    1: inside its node (N > 1, and every replica of its expert on another node: the ranks of
    the node still reach it first, and the candidates keep their node order); 0: nowhere.
    """
    L, P = phy2log_LP.shape
    E = int(phy2log_LP.max()) + 1
    num_gpus, num_nodes = topology.num_gpus, topology.num_nodes
    S = P // num_gpus
    node_P = np.arange(P) // S // (num_gpus // num_nodes)
    rows = np.broadcast_to(np.arange(L)[:, None], (L, P))
    count_LE = np.zeros((L, E), dtype=np.int64)
    np.add.at(count_LE, (rows, phy2log_LP), 1)
    per_node_LEN = np.zeros((L, E, num_nodes), dtype=np.int64)
    np.add.at(per_node_LEN, (rows, phy2log_LP, np.broadcast_to(node_P, (L, P))), 1)
    count_LP = np.take_along_axis(count_LE, phy2log_LP, axis=1)
    spread_LE = per_node_LEN.max(axis=2) == 1
    spread_LP = np.take_along_axis(spread_LE, phy2log_LP, axis=1)
    return np.where(count_LP == 1, 2, np.where(spread_LP & (num_nodes > 1), 1, 0)).astype(np.int8)


def _best_swap(phy_P, x_P, move_P, old_GE, gpu_P, node_P, G: int):
    """The swap between a slot of the busiest GPU and a slot of another GPU that lowers the
    busiest GPU most per move, or None.

    Returns (gain, moves, a, b): gain = the busiest load - the larger of the two GPUs' loads
    after it (> 0), moves = change in copies against the served placement (old_GE). Swaps
    that copy nothing (moves <= 0) come first, by gain. Whole-array numpy: a compiled version
    saved nothing measurable on the rebalance it serves (benchmarks/bench_kernels.py).
    """
    g_G = np.bincount(gpu_P, weights=x_P, minlength=G)
    top = int(np.argmax(g_G))
    a = np.flatnonzero(gpu_P == top)
    b = np.flatnonzero(gpu_P != top)
    ea, eb = phy_P[a][:, None], phy_P[b][None, :]
    ga, gb = top, gpu_P[b][None, :]
    d = x_P[a][:, None] - x_P[b][None, :]
    gain = g_G[top] - np.maximum(g_G[top] - d, g_G[gb] + d)
    holds = np.zeros((G, int(phy_P.max()) + 1), dtype=bool)
    holds[gpu_P, phy_P] = True
    ok = (gain > 0) & ~holds[gb, ea] & ~holds[ga, eb]
    same_node = node_P[a][:, None] == node_P[b][None, :]
    ok &= (move_P[a][:, None] == 2) | ((move_P[a][:, None] == 1) & same_node)
    ok &= (move_P[b][None, :] == 2) | ((move_P[b][None, :] == 1) & same_node)
    if not ok.any():
        return None
    new = ~old_GE
    moves = (new[gb, ea].astype(np.int64) + new[ga, eb]) - (new[ga, ea].astype(np.int64) + new[gb, eb])
    free = ok & (moves <= 0)
    pick = free if free.any() else ok
    i, j = np.unravel_index(int(np.argmax(np.where(pick, gain / np.maximum(moves, 1), -np.inf))), ok.shape)
    return float(gain[i, j]), int(moves[i, j]), int(a[i]), int(b[j])


def repair_swaps(load_LE: np.ndarray, start_LP: np.ndarray, w_LP: np.ndarray, old_LP: np.ndarray,
                 topology: Topology, budget: Budget,
                 used_LG: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Swaps of replicas that keep every share `w_LP` of the rule, lowering busiest GPUs within the budget.

    start_LP: a full placement, w_LP: the rule's shares on it (bound once: the swaps keep
    them, see `_movable`); old_LP: the served placement moves are counted against; used_LG:
    moves start_LP already makes. Swaps are bought best gain per move first, over all layers,
    while a swap's gain pays its price (Budget.move_cost x the layer's mean GPU load per move)
    and the budget's move limits hold. A swap lowers the busiest GPU, not always the layer's
    peak (another GPU may be as busy), so each layer then keeps the prefix of its swaps with
    the lowest peak plus move price (the swaps of one layer change nothing in another: no
    share moves). Returns (the new placement, int64 [L, P], and its shares, the same as
    binding the rule to it gives).
    """
    L, P = start_LP.shape
    G, num_nodes, E = topology.num_gpus, topology.num_nodes, load_LE.shape[1]
    S = P // G
    phy_LP = np.array(start_LP, dtype=np.int64, copy=True)
    w0_LP = np.asarray(w_LP, dtype=np.float64)
    w_LP = w0_LP.copy()
    x_LP = np.take_along_axis(load_LE, phy_LP, axis=1) * w_LP
    x0_LP = x_LP.copy()
    move_LP = _movable(phy_LP, topology)
    gpu_P = np.arange(P) // S
    node_P = gpu_P // (G // num_nodes)
    old_LGE = np.zeros((L, G, E), dtype=bool)
    l_i, p_i = np.nonzero(old_LP >= 0)
    old_LGE[l_i, p_i // S, old_LP[l_i, p_i]] = True
    in_G = np.zeros(G, dtype=np.int64) if used_LG is None else used_LG.sum(axis=0).astype(np.int64)
    left = None if budget.max_moves is None else budget.max_moves - int(in_G.sum())
    price_L = budget.move_cost * load_LE.sum(axis=1) / G
    heap: list = []
    done: list[list] = [[] for _ in range(L)]  # per layer: (slot a, slot b, moves so far, peak after)

    def push(l: int) -> None:
        best = _best_swap(phy_LP[l], x_LP[l], move_LP[l], old_LGE[l], gpu_P, node_P, G)
        if best is not None and best[0] > price_L[l] * max(best[1], 0) + 1e-12 * x_LP[l].sum():
            gain, moves = best[0], best[1]
            heapq.heappush(heap, (-(gain / moves if moves > 0 else np.inf), l, best))

    for l in range(L):
        push(l)
    while heap:
        _, l, (gain, moves, a, b) = heapq.heappop(heap)
        ga, gb = a // S, b // S
        add_a = int(not old_LGE[l, ga, phy_LP[l, b]]) - int(not old_LGE[l, ga, phy_LP[l, a]])
        add_b = int(not old_LGE[l, gb, phy_LP[l, a]]) - int(not old_LGE[l, gb, phy_LP[l, b]])
        if left is not None and moves > left:
            continue  # this layer's best swap is too dear now; cheaper ones of other layers may fit
        if budget.max_moves_per_gpu is not None and (in_G[ga] + add_a > budget.max_moves_per_gpu
                                                     or in_G[gb] + add_b > budget.max_moves_per_gpu):
            continue
        for arr in (phy_LP, x_LP, w_LP, move_LP):
            arr[l, a], arr[l, b] = arr[l, b], arr[l, a]
        in_G[ga] += add_a
        in_G[gb] += add_b
        if left is not None:
            left -= moves
        done[l].append((a, b, (done[l][-1][2] if done[l] else 0) + moves,
                        np.bincount(gpu_P, weights=x_LP[l], minlength=G).max()))
        push(l)
    # Each layer's best prefix of its swaps, replayed from the start.
    phy_LP[:] = start_LP
    w_LP[:] = w0_LP
    for l, swaps in enumerate(done):
        if not swaps:
            continue
        cost = np.array([x0_LP[l].reshape(G, S).sum(axis=1).max()] + [s[3] + price_L[l] * s[2] for s in swaps])
        for a, b, _, _ in swaps[:int(np.flatnonzero(cost <= cost.min() * (1 + 1e-12))[0])]:
            for arr in (phy_LP, w_LP):
                arr[l, a], arr[l, b] = arr[l, b], arr[l, a]
    return phy_LP, w_LP


def _take(phy2log_LP: np.ndarray, perm_LP: np.ndarray) -> np.ndarray:
    return np.take_along_axis(phy2log_LP, perm_LP, axis=1)


@dataclass(frozen=True, eq=False)
class _Candidate:
    """One placement the migration step may return, bound to the rule."""

    phy2log_LP: np.ndarray
    perm_LP: np.ndarray | None
    """Slot of the planner's plan behind each slot, when the candidate is that plan renamed, else None."""
    peak_L: np.ndarray
    """Busiest GPU's load per layer under the rule, [L]."""
    w_LP: np.ndarray
    """The rule's shares on phy2log_LP, [L, P]."""
    within_budget: bool
    """Built from the served placement within the budget (else its moves are checked)."""
    kept_layers: int = 0
    """Layers put back as served, where the candidate served them worse."""


def _no_layer_worse(request, c: _Candidate, start_LP: np.ndarray, keep_L: np.ndarray, rounds: int = 8):
    """c with every layer the rule serves worse than keeping the placement put back as served
    (rebinding after each round: a layer put back changes the draws of the layers after it);
    None when some layer is still worse after `rounds` rounds."""
    topo = request.topology
    phy, peak_L, w_LP, kept = c.phy2log_LP, c.peak_L, c.w_LP, np.zeros(len(keep_L), dtype=bool)
    for _ in range(rounds):
        worse = peak_L > keep_L * (1 + 1e-12)
        if not worse.any():
            perm = c.perm_LP if not kept.any() else None
            return _Candidate(phy, perm, peak_L, w_LP, c.within_budget, int(kept.sum()))
        kept |= worse
        phy = np.where(kept[:, None], start_LP, phy)
        peak_L, w_LP = served_peaks(request.dispatch, phy, request.load_LE, topo, request.layer_ids)
    return None


def _candidates(request, target_LP: np.ndarray, budget: Budget, start_LP: np.ndarray) -> dict[str, _Candidate]:
    """Every candidate of the module text, bound to the rule; with a budget, none serves a layer
    worse than keeping the placement."""
    topo, load_LE, rule = request.topology, request.load_LE, request.dispatch
    G, N, E = topo.num_gpus, topo.num_nodes, request.num_logical_experts
    old_LP = request.previous.phy2log_LP

    def bound(phy, perm=None, within=False):
        return _Candidate(phy, perm, *served_peaks(rule, phy, load_LE, topo, request.layer_ids), within)

    perm_LP = keep_slots(old_LP, target_LP, G)
    out = {"planned": bound(_take(target_LP, perm_LP), perm_LP)}
    rel_LP = relabel(old_LP, target_LP, G, E, N)
    relabeled = _take(target_LP, rel_LP)
    out["relabel"] = (_Candidate(relabeled, rel_LP, out["planned"].peak_L, out["planned"].w_LP, False)
                      if np.array_equal(relabeled, out["planned"].phy2log_LP) else bound(relabeled, rel_LP))
    if not budget.limited:
        return out
    keep = out["previous"] = bound(start_LP, within=True)
    searched = budgeted_search(load_LE, start_LP, G, budget, num_nodes=N, num_expert_groups=request.num_expert_groups)
    out["budgeted_search"] = bound(_take(searched, keep_slots(old_LP, searched, G)), within=True)
    for name in ("planned", "relabel", "budgeted_search"):
        c = _no_layer_worse(request, out.pop(name), start_LP, keep.peak_L)
        if c is not None:
            out[name] = c
    # Swaps that keep the rule's shares (so the repaired shares are known without binding again)
    # lower busiest GPUs only: from a candidate no layer of which is worse, none becomes worse.
    for name, c in [("repair", keep)] + ([("budgeted_search+repair", out["budgeted_search"])]
                                          if "budgeted_search" in out else []):
        phy, w_LP = repair_swaps(load_LE, c.phy2log_LP, c.w_LP, old_LP, topo, budget,
                                 count_moves(old_LP, c.phy2log_LP, G, E))
        out[name] = _Candidate(phy, None, gpu_loads(phy, load_LE, G, w_LP).max(axis=1), w_LP, True, c.kept_layers)
    return out


NOTES = {
    "previous": "the previous placement kept",
    "repair": "share-keeping swaps on the previous placement",
    "budgeted_search": "move-budgeted search from the previous placement",
    "budgeted_search+repair": "move-budgeted search from the previous placement, then share-keeping swaps",
    "planned": "the plan", "relabel": "the plan relabelled",
}
"""How each candidate was made, for the Solution's message."""


def migrate_for_rule(request, target_LP: np.ndarray, budget: Budget, start_LP: np.ndarray):
    """The migration step under a layout-dependent rule: (phy2log_LP, perm_LP or None, info).

    request: the PlanRequest (its dispatch rule, load, topology, previous); target_LP: the
    planner's plan; start_LP: the served placement with every expert present (experts lost
    with failed ranks restored). perm_LP maps each slot of the result to a slot of target_LP
    when the result is the plan (its weights can follow), else None. info: the chosen method,
    its moves, a note saying how it was made, and every candidate's served peak sum and moves.
    """
    topo, load_LE = request.topology, np.asarray(request.load_LE, dtype=np.float64)
    G, N, E = topo.num_gpus, topo.num_nodes, request.num_logical_experts
    K = request.num_expert_groups
    old_LP = request.previous.phy2log_LP
    price_L = budget.move_cost * load_LE.sum(axis=1) / G
    span = budget.limited and span_priced(N, K, budget)
    if span:
        pairs0_L = group_span(start_LP, topo, K, E).sum(axis=1)
    scored = {}
    for name, c in _candidates(request, target_LP, budget, start_LP).items():
        moves_LG = count_moves(old_LP, c.phy2log_LP, G, E)
        moves_L = moves_LG.sum(axis=1)
        fits = c.within_budget or ((budget.max_moves is None or moves_L.sum() <= budget.max_moves) and (
            budget.max_moves_per_gpu is None or moves_LG.sum(axis=0).max() <= budget.max_moves_per_gpu))
        cost = float((c.peak_L + price_L * moves_L).sum())
        if span:  # the search's price of spreading groups over nodes, in moves
            cost += float((price_L * budget.span_cost * (group_span(c.phy2log_LP, topo, K, E).sum(axis=1)
                                                         - pairs0_L)).sum())
        scored[name] = (c, int(moves_L.sum()), fits, cost)
    ok = [n for n, v in scored.items() if v[2]]
    # The cheapest; among those within rounding of it, the fewest moves.
    least = min(scored[n][3] for n in ok)
    best = min((n for n in ok if scored[n][3] <= least + 1e-9 * abs(least)), key=lambda n: scored[n][1])
    c = scored[best][0]
    note = NOTES[best] + (f", {c.kept_layers} layer(s) kept as served where it served them worse"
                          if c.kept_layers else "")
    info = {
        "method": best, "dispatch": request.dispatch.name, "note": note, "kept_layers": c.kept_layers,
        "moves_from_scratch": int(count_moves(old_LP, target_LP, G, E).sum()),
        "moves_relabeled": int(count_moves(old_LP, _take(target_LP, relabel(old_LP, target_LP, G, E, N)), G, E).sum()),
        "candidates": {n: {"served_peak_sum": float(v[0].peak_L.sum()), "moves": v[1], "fits": bool(v[2]),
                           "cost": v[3]} for n, v in scored.items()},
    }
    return c.phy2log_LP, c.perm_LP, info
