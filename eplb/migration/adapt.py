"""Migration-aware planning: fit a from-scratch plan to the served placement and a move budget.

Legend: L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU, P = G x S slots.

`migrate` relabels the planner's plan onto the old placement (same balance, fewer moves) and,
when a budget limits the moves, compares it with the budgeted search from the old placement;
`restore_missing` first gives experts lost with failed ranks a replica again.
`adapt_solution` is the front door's migration step on a planner's Solution.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from eplb.core.placement import gpu_loads
from eplb.core.topology import Topology
from eplb.errors import EplbError
from eplb.migration.checks import check_load_and_maps
from eplb.migration.moves import count_moves, keep_slots, relabel
from eplb.migration.rule import layout_dependent, migrate_for_rule
from eplb.migration.search import Budget, budgeted_search, span_priced
from eplb.stats.loads import group_span


def max_load(load_LE: np.ndarray, phy2log_LP: np.ndarray, num_gpus: int) -> np.ndarray:
    """Busiest GPU's load per layer under even dispatch, [L] (slots < 0 hold nothing)."""
    load_LE = np.asarray(load_LE, dtype=np.float64)
    L, E = load_LE.shape
    valid = phy2log_LP >= 0
    r_LE = np.bincount((np.arange(L)[:, None] * E + phy2log_LP)[valid], minlength=L * E).reshape(L, E)
    # Each replica's load divided out here, not as gpu_loads' even-split weights (x * (1/r)):
    # the search compares these sums, and x / r is what its kernels compute.
    return gpu_loads(phy2log_LP, load_LE / np.maximum(r_LE, 1), num_gpus, 1.0).max(axis=1)


def _restore_layer(row: np.ndarray, load_E: np.ndarray, G: int, S: int, l: int) -> None:
    """restore_missing on one layer's slots, in place."""
    P, E = row.size, load_E.size
    present = np.zeros(E, dtype=np.int64)
    np.add.at(present, row[row >= 0], 1)
    missing = np.flatnonzero(present == 0)
    if missing.size == 0 and (row >= 0).all():
        return
    for e in missing[np.argsort(-load_E[missing], kind="stable")]:
        r = np.maximum(present, 1)
        w = np.where(row >= 0, load_E[np.maximum(row, 0)] / r[np.maximum(row, 0)], 0.0)
        gl = w.reshape(G, S).sum(axis=1)
        holds = np.zeros(G, bool)
        holds[np.arange(P)[row == e] // S] = True
        empty = row < 0
        donor = (row >= 0) & (present[np.maximum(row, 0)] >= 2)
        ok = (empty | donor) & ~holds[np.arange(P) // S]
        if not ok.any():
            ok = empty | donor
        if not ok.any():
            raise EplbError(f"{P} slots cannot hold all {E} experts in layer index {l}")
        # Prefer empty slots, then light GPUs, then cheap donors.
        score = np.where(empty, -1e300, gl[np.arange(P) // S] + np.where(donor, w, 0))
        q = int(np.argmin(np.where(ok, score, np.inf)))
        if row[q] >= 0:
            present[row[q]] -= 1
        row[q] = e
        present[e] += 1
    # Leftover empty slots take extra replicas of the heaviest experts per replica.
    for q in np.flatnonzero(row < 0):
        held = set(row[(np.arange(P) // S) == q // S].tolist())
        per = load_E / np.maximum(present, 1)
        per[list(h for h in held if h >= 0)] = -1.0
        e = int(np.argmax(per))
        row[q] = e
        present[e] += 1


def restore_missing(load_LE: np.ndarray, phy2log_LP: np.ndarray, num_gpus: int) -> np.ndarray:
    """Give every expert without a replica (-1 slots or experts absent) one, heaviest first.

    Empty slots (-1) are used first; then the slot of a replica whose expert has the most
    replicas and the lowest load per replica, on the least-loaded GPU that does not hold the
    expert. Returns a copy of phy2log_LP with no expert missing.
    """
    load_LE, _, _ = check_load_and_maps(load_LE, num_gpus, phy2log_LP=phy2log_LP)
    phy = np.array(phy2log_LP, dtype=np.int64, copy=True)
    L, P = phy.shape
    for l in range(L):
        _restore_layer(phy[l], load_LE[l], num_gpus, P // num_gpus, l)
    return phy


def migrate(load_LE: np.ndarray, old_LP: np.ndarray, target_LP: np.ndarray, topology: Topology,
            budget: Budget | None = None, num_expert_groups: int | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
    """Turn a from-scratch plan for `topology` into one that fits the old placement and the budget.

    Returns (phy2log_LP, perm_LP, info). perm_LP maps each slot of the result to a slot of
    target_LP (so the planner's dispatch weights can follow), or is None when the budgeted
    search replaced the target. info holds the move counts of each candidate. On more than one
    node and with num_expert_groups the search keeps each layer's group span (see `budgeted_search`).
    """
    if not isinstance(topology, Topology):
        raise EplbError(f"topology must be an eplb.Topology, got {type(topology).__name__}: "
                        f"pass Topology(num_gpus=, slots_per_gpu=, num_nodes=)")
    num_gpus, num_nodes = topology.num_gpus, topology.num_nodes
    load_LE, L, P = check_load_and_maps(load_LE, num_gpus, old_LP=old_LP, target_LP=target_LP)
    if P != num_gpus * topology.slots_per_gpu:
        raise EplbError(f"the maps have {P} slots a layer, but {topology} holds "
                        f"{num_gpus * topology.slots_per_gpu}: pass the topology the maps were made for")
    old_LP = np.asarray(old_LP, dtype=np.int64)
    target_LP = np.asarray(target_LP, dtype=np.int64)
    if (target_LP < 0).any():
        l, p = np.argwhere(target_LP < 0)[0]
        raise EplbError(f"target_LP has an empty slot ({p} of layer index {l}): a plan fills every slot")
    E = load_LE.shape[1]
    budget = budget or Budget()
    perm = relabel(old_LP, target_LP, num_gpus, E, num_nodes)
    relabeled = np.take_along_axis(target_LP, perm, axis=1)
    moves_scratch = int(count_moves(old_LP, target_LP, num_gpus, E).sum())
    moves_rel_LG = count_moves(old_LP, relabeled, num_gpus, E)
    info = {"moves_from_scratch": moves_scratch, "moves_relabeled": int(moves_rel_LG.sum())}
    if not budget.limited:
        info["method"] = "relabel"
        return relabeled, perm, info
    present_LE = np.bincount((np.arange(L)[:, None] * E + old_LP)[old_LP >= 0], minlength=L * E)
    start = restore_missing(load_LE, old_LP, num_gpus) if (old_LP < 0).any() or (present_LE == 0).any() else old_LP
    searched = budgeted_search(load_LE, start, num_gpus, budget, num_nodes=num_nodes,
                               num_expert_groups=num_expert_groups)
    searched = np.take_along_axis(searched, keep_slots(old_LP, searched, num_gpus), axis=1)
    # The relabelled target wins if the budget can pay for it and it costs no more: summed
    # busiest-GPU load plus move_cost x the layer's mean GPU load per move (the search's price,
    # new (group, node) pairs included).
    fits = ((budget.max_moves is None or moves_rel_LG.sum() <= budget.max_moves)
            and (budget.max_moves_per_gpu is None or moves_rel_LG.sum(axis=0).max() <= budget.max_moves_per_gpu))
    price_L = budget.move_cost * load_LE.sum(axis=1) / num_gpus
    span = span_priced(num_nodes, num_expert_groups, budget)
    if span:
        pairs0_L = group_span(old_LP, topology, num_expert_groups, E).sum(axis=1)

    def cost(phy):
        moves_L = count_moves(old_LP, phy, num_gpus, E).sum(axis=1).astype(np.float64)
        if span:   # the search's price of spreading groups over nodes, in moves
            moves_L += budget.span_cost * (group_span(phy, topology, num_expert_groups, E).sum(axis=1) - pairs0_L)
        return float((max_load(load_LE, phy, num_gpus) + price_L * moves_L).sum())

    if fits and cost(relabeled) <= cost(searched):
        info["method"] = "relabel"
        return relabeled, perm, info
    info["method"] = "budgeted_search"
    return searched, None, info


def adapt_solution(request, sol, budget: Budget):
    """The front door's migration step: a planner's Solution made to fit request.previous.

    request: the PlanRequest (load_LE, topology, num_expert_groups, previous); sol: the
    planner's Solution, returned changed with `dataclasses.replace`. Relabels the planner's
    plan onto the previous placement (balance unchanged) or, when the budget cannot pay for
    that, replaces it by the budgeted search from the previous placement (status HEURISTIC,
    message says so). Under a rule whose shares follow the layout (request.dispatch, SGLang's)
    the candidates are judged by binding that rule instead (`migrate_for_rule`). Move counts
    (and bytes, from budget.bytes_per_expert) go to info["migration"].
    """
    prev, topo = request.previous, request.topology
    if prev.num_gpus != topo.num_gpus or prev.num_nodes != topo.num_nodes:
        raise EplbError(f"previous placement is for {prev.num_gpus} GPUs on {prev.num_nodes} node(s); "
                        f"this plan is for {topo.num_gpus} on {topo.num_nodes}: plan for the same GPUs")
    bytes_per_expert = budget.bytes_per_expert
    t0 = time.perf_counter()
    if layout_dependent(request.dispatch):
        # The rule's shares follow the layout: every candidate is judged by binding the rule (rule.py).
        start = prev.phy2log_LP
        if prev.partial or (start < 0).any():
            start = restore_missing(request.load_LE, start, topo.num_gpus)
        phy, perm, info = migrate_for_rule(request, np.asarray(sol.phy2log_LP, dtype=np.int64), budget, start)
    else:
        phy, perm, info = migrate(request.load_LE, prev.phy2log_LP, sol.phy2log_LP, topo, budget,
                                  request.num_expert_groups)
    weights = None
    if perm is not None and sol.dispatch_weights_LP is not None:
        weights = np.take_along_axis(np.asarray(sol.dispatch_weights_LP), perm, axis=1)
    moves_LG = count_moves(prev.phy2log_LP, phy, topo.num_gpus, request.num_logical_experts)
    info.update({
        "moves": int(moves_LG.sum()),
        "moves_max_per_gpu": int(moves_LG.sum(axis=0).max()),
        "bytes": None if bytes_per_expert is None else int(moves_LG.sum()) * int(bytes_per_expert),
        "max_moves": budget.max_moves, "max_moves_per_gpu": budget.max_moves_per_gpu,
        "move_cost": budget.move_cost, "seconds": time.perf_counter() - t0,
    })
    if topo.num_nodes > 1 and request.num_expert_groups:
        info.update(span_cost=budget.span_cost, **{
            f"group_span_{k}": float(group_span(m, topo, request.num_expert_groups, request.num_logical_experts).mean())
            for k, m in (("before", prev.phy2log_LP), ("after", phy))})
    if perm is not None:  # the planner's plan, renamed or with its slots reordered
        return dataclasses.replace(sol, phy2log_LP=phy, dispatch_weights_LP=weights,
                                   info={**sol.info, "migration": info})
    how = info.get("note", "move-budgeted search from the previous placement")
    split = f"judged under {info['dispatch']}" if "dispatch" in info else "even dispatch"
    note = (f"{how} ({info['moves']} moves; the planner's own plan needed {info['moves_relabeled']} after "
            f"relabelling), {split}")
    return dataclasses.replace(sol, phy2log_LP=phy, dispatch_weights_LP=None, status="HEURISTIC",
                               message=f"{sol.message}; {note}" if sol.message else note,
                               info={**sol.info, "migration": info})
