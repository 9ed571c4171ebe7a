"""The per-layer CP-SAT model of the `ilp` planner, with its integer loads and its hints.

Legend: E = logical experts, G = GPUs, S = slots per GPU, P = G x S slots.

The model (one layer; `dispatch="weighted"`):
  x[e, g]  bool   expert e has a replica on GPU g (at most one per GPU: two copies on one
                  GPU never lower that GPU's load)
  f[e, g]  int    tokens of expert e served by its replica on GPU g
  z        int    the busiest GPU's load, minimised
With `dispatch="even"` (engines that split an expert's tokens evenly among its replicas), the
shares are not free: r[e] = number of replicas, and every replica of e serves load_e / r[e]
(a table lookup on r[e], so the model is exact, not linearised).

Loads are scaled to integers per layer (`scale_loads`): load_e x RESOLUTION / layer total,
rounded (the layer's total becomes ~2^24, so one unit is ~2e-6 of a GPU's mean load at 32
GPUs). Even-split per-replica loads are rounded up. Every variable gets a hint (a complete
solution): greedy's placement with its exact LP shares rounded to integers (`integer_shares`),
or the wrap-around `chain_fill` placement where that is better. z >= the integer lower bound,
so a hint that meets it is optimal as it is and CP-SAT is not run.
"""

from __future__ import annotations

import time

import numpy as np

from eplb import stats
from eplb.core.topology import Topology

RESOLUTION = 1 << 24
"""Scaled total load of one layer, in integer units."""

def scale_loads(load_E: np.ndarray) -> np.ndarray:
    """Integer loads [E] summing to ~RESOLUTION (0 stays 0; any positive load stays >= 1)."""
    total = float(load_E.sum())
    if total <= 0:
        return np.zeros(load_E.shape, dtype=np.int64)
    scaled = np.rint(load_E * (RESOLUTION / total)).astype(np.int64)
    return np.where(load_E > 0, np.maximum(scaled, 1), 0)


def integer_shares(load_E: np.ndarray, phy2log_P: np.ndarray, weights_P: np.ndarray) -> np.ndarray:
    """Round per-slot token amounts to integers that sum to each expert's integer load.

    Largest-remainder rounding per expert: floor every share, then hand the missing units to
    the replicas with the largest fractional parts.
    """
    exact_P = load_E[phy2log_P] * weights_P
    out_P = np.floor(exact_P).astype(np.int64)
    short_E = load_E - np.bincount(phy2log_P, weights=out_P, minlength=load_E.size).astype(np.int64)
    order = np.lexsort((-(exact_P - out_P), phy2log_P))  # by expert, then largest remainder first
    rank = np.empty_like(order)
    starts = np.searchsorted(phy2log_P[order], phy2log_P[order])
    rank[order] = np.arange(order.size) - starts
    out_P += rank < short_E[phy2log_P]
    return out_P


def balanced_groups(load_E: np.ndarray, num_gpus: int, passes: int = 4) -> list[list[int]]:
    """Split experts into G groups of E // G or E // G + 1 with near-equal total loads.

    Heaviest expert to the lightest group, one expert per group per round; then pairwise
    swaps (heaviest groups against lightest) that lower the two groups' squared deviation.
    """
    E, G = load_E.size, num_gpus
    w = load_E.astype(np.float64)
    order = np.argsort(-w, kind="stable")
    members: list[list[int]] = [[] for _ in range(G)]
    sums = np.zeros(G)
    for start in range(0, E, G):
        batch = order[start:start + G]
        for e, g in zip(batch, np.argsort(sums, kind="stable")[:len(batch)]):
            members[g].append(int(e))
            sums[g] += w[e]
    mean = w.sum() / G
    for _ in range(passes):
        improved = False
        by_sum = np.argsort(-sums)
        for gh in by_sum[: G // 2]:
            for gl in by_sum[::-1][: G // 2]:
                if gh == gl:
                    continue
                a, b = np.array(members[gh]), np.array(members[gl])
                delta = w[a][:, None] - w[b][None, :]       # load moved from gh to gl
                cost = (sums[gh] - delta - mean) ** 2 + (sums[gl] + delta - mean) ** 2
                i, j = np.unravel_index(np.argmin(cost), cost.shape)
                if cost[i, j] < (sums[gh] - mean) ** 2 + (sums[gl] - mean) ** 2 - 1e-9 * mean * mean:
                    members[gh][i], members[gl][j] = int(b[j]), int(a[i])
                    sums[gh] -= delta[i, j]
                    sums[gl] += delta[i, j]
                    improved = True
        if not improved:
            break
    return members


def chain_fill(load_E: np.ndarray, topology: Topology, level: int, groups=None):
    """Wrap-around filling at a GPU load `level` (weighted dispatch): (phy2log_P, share_P) or None.

    McNaughton's wrap-around rule with slot limits, for integer loads:
    Step 1: split the experts into G groups of ~E/G with near-equal loads (`balanced_groups`;
            pass `groups` to reuse them across levels).
    Step 2: fill GPUs in turn up to `level`: GPU k gets the carry-over of GPU k - 1, then a
            group, its hottest expert last; that expert's overflow goes to a second replica
            opening GPU k + 1. The carry after GPU k is D_{k+1} = D_k + load(group) - level;
            the next group is the lightest one that keeps 0 <= D_{k+1} < its hottest expert
            (so that expert starts on GPU k and the next GPU still has room); when no group
            reaches `level` (it is above the mean), the heaviest that fits stays whole.
    Every GPU but the last is filled to exactly `level`, so at level = the lower bound the
    result is optimal. Needs E / G + 1 <= S (about one redundant slot per GPU); returns None
    when the slots or the level do not allow it. Spare slots get zero-share replicas of the
    hottest experts not already on that GPU (room for re-splitting later).
    """
    E, G, S = load_E.size, topology.num_gpus, topology.slots_per_gpu
    if -(-E // G) + 1 > S:
        return None
    order = np.argsort(-load_E, kind="stable")
    members = [list(m) for m in (groups if groups is not None else balanced_groups(load_E, G))]
    members = [sorted(m, key=lambda e: -int(load_E[e])) for m in members]
    sums = np.array([int(load_E[m].sum()) for m in members], dtype=np.int64)
    # Step 2: sequence the groups and fill.
    left = list(range(G))
    carry: tuple[int, int] | None = None
    d = 0
    gpu_items: list[list[tuple[int, int]]] = []
    for k in range(G):
        if k == G - 1:
            g = left[0]
            if d + int(sums[g]) > level:
                return None
        else:
            fits = [g for g in left if d + int(sums[g]) - level < int(load_E[members[g][0]])]
            over = [g for g in fits if d + int(sums[g]) >= level]
            if over:
                g = min(over, key=lambda g: int(sums[g]))
            elif fits:
                # Level above the mean: this GPU stays below it (no overflow, no carry).
                g = max(fits, key=lambda g: int(sums[g]))
            else:
                return None
        left.remove(g)
        items = [] if carry is None else [carry]
        *fillers, straddler = members[g][::-1]          # coldest first, hottest last
        items += [(e, int(load_E[e])) for e in fillers]
        if k == G - 1:
            items.append((straddler, int(load_E[straddler])))
        else:
            piece = min(int(load_E[straddler]), level - d - (int(sums[g]) - int(load_E[straddler])))
            items.append((straddler, piece))
            d = int(load_E[straddler]) - piece
            carry = (straddler, d) if d > 0 else None
        gpu_items.append(items)
    phy2log_P = np.empty(G * S, dtype=np.int64)
    share_P = np.zeros(G * S, dtype=np.int64)
    for g, items in enumerate(gpu_items):
        held = {e for e, _ in items}
        assert len(held) == len(items) <= S, "chain_fill broke a slot rule"
        spare = [int(e) for e in order if int(e) not in held][: S - len(items)]
        for j, (e, amount) in enumerate(items + [(e, 0) for e in spare]):
            phy2log_P[g * S + j] = e
            share_P[g * S + j] = amount
    return phy2log_P, share_P


def best_chain(load_E: np.ndarray, topology: Topology, lower: int, upper: int):
    """The lowest level in [lower, upper) at which chain_fill succeeds (bisection), or None."""
    groups = balanced_groups(load_E, topology.num_gpus)
    best = chain_fill(load_E, topology, lower, groups)
    if best is not None:
        return best
    lo, hi = lower, upper                               # fails at lo; hi unknown
    for _ in range(12):
        if hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        got = chain_fill(load_E, topology, mid, groups)
        if got is None:
            lo = mid
        else:
            best, hi = got, mid
    return best


def integer_lower_bound(load_E: np.ndarray, num_gpus: int, num_slots: int) -> int:
    """`eplb.stats.lower_bound` for integer loads, exact: z >= ceil(total / G) and
    z >= ceil(load_e / r_e) for the replica counts r minimising the largest per-replica load."""
    r_E = stats.replica_counts_minmax(load_E[None].astype(np.float64), num_slots)[0]
    return max(-(-int(load_E.sum()) // num_gpus), max(-(-int(v) // int(r)) for v, r in zip(load_E, r_E)))


def solve_layer(load_E: np.ndarray, hint_phy2log_P: np.ndarray, hint_w_P: np.ndarray | None,
                topology: Topology, dispatch: str, time_limit: float, workers: int, seed: int,
                chain: bool = True) -> dict:
    """One layer's CP-SAT model: returns phy2log_P (or None), status, objective, bound, seconds.

    load_E: integer loads; hint_phy2log_P / hint_w_P: the greedy placement and (weighted) its LP
    shares. With `chain` (weighted only), the hint is the better of greedy and `best_chain`.
    A hint that meets the lower bound is optimal as it is: CP-SAT is then not run.
    """
    t0 = time.perf_counter()
    G, S = topology.num_gpus, topology.slots_per_gpu
    lower = integer_lower_bound(load_E, G, G * S)
    # Step 1: the hint, and its busiest GPU.
    hint_phy2log_P, hint_share_P, hint_source = _hint(load_E, hint_phy2log_P, hint_w_P, topology, dispatch,
                                                      lower, chain)
    hint_z = int(hint_share_P.reshape(G, S).sum(axis=1).max())
    out = {"status": "OPTIMAL", "seconds": 0.0, "hint_objective": hint_z, "hint": hint_source,
           "lower": lower, "phy2log_P": hint_phy2log_P, "hint_phy2log_P": hint_phy2log_P, "objective": hint_z,
           "bound": lower}
    if hint_z <= lower:
        # The hint meets the analytic bound: proven optimal without search.
        out["seconds"] = time.perf_counter() - t0
        return out
    # Step 2: the model, every variable hinted.
    model, x, z = _model(load_E, hint_phy2log_P, hint_share_P, topology, dispatch, lower, hint_z)
    # Step 3: solve; read the GPUs' experts back.
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_workers = int(workers)
    solver.parameters.random_seed = int(seed)
    # One presolve pass: on DeepSeek-V3 layers (16k variables) the default three can use up a
    # 12 s limit on a busy machine before the hint is even loaded.
    solver.parameters.max_presolve_iterations = 1
    status = solver.solve(model)
    out.update(status=solver.status_name(status), seconds=time.perf_counter() - t0, phy2log_P=None,
               objective=None, bound=None)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        held = np.array([[solver.boolean_value(x[e, g]) for g in range(G)] for e in range(load_E.size)])
        # Slots of GPU g, in expert-id order.
        out["phy2log_P"] = np.concatenate([np.flatnonzero(held[:, g]) for g in range(G)]).astype(np.int64)
        out["objective"] = int(solver.objective_value)
        out["bound"] = int(solver.best_objective_bound)
    return out


def _hint(load_E, hint_phy2log_P, hint_w_P, topology: Topology, dispatch: str, lower: int, chain: bool):
    """The complete solution CP-SAT starts from: (phy2log_P, integer tokens per slot [P], its
    source "greedy" or "chain")."""
    G, S = topology.num_gpus, topology.slots_per_gpu
    if dispatch != "weighted":
        count_E = np.bincount(hint_phy2log_P, minlength=load_E.size)
        return hint_phy2log_P, (-(-load_E // count_E))[hint_phy2log_P], "greedy"
    share_P = integer_shares(load_E, hint_phy2log_P, hint_w_P)
    greedy_z = int(share_P.reshape(G, S).sum(axis=1).max())
    if chain and greedy_z > lower:
        got = best_chain(load_E, topology, lower, greedy_z)
        if got is not None and int(got[1].reshape(G, S).sum(axis=1).max()) < greedy_z:
            return got[0], got[1], "chain"
    return hint_phy2log_P, share_P, "greedy"


def _model(load_E, hint_phy2log_P, hint_share_P, topology: Topology, dispatch: str, lower: int, hint_z: int):
    """The layer's CP-SAT model minimising the busiest GPU, hinted: (model, x[e, g], z)."""
    from ortools.sat.python import cp_model

    E, G, S = load_E.size, topology.num_gpus, topology.slots_per_gpu
    max_replicas = min(G, G * S - E + 1)
    gpu_P = np.arange(G * S) // S
    hint_x = np.zeros((E, G), dtype=bool)
    hint_x[hint_phy2log_P, gpu_P] = True
    model = cp_model.CpModel()
    x = {}
    for e in range(E):
        for g in range(G):
            x[e, g] = model.new_bool_var(f"x[{e},{g}]")
            model.add_hint(x[e, g], bool(hint_x[e, g]))
    # Each GPU holds exactly its slot count of experts (at most one replica of each).
    for g in range(G):
        model.add(sum(x[e, g] for e in range(E)) == S)
    # Every expert has at least one replica, and no more than there are GPUs or spare slots allow.
    for e in range(E):
        model.add(sum(x[e, g] for g in range(G)) >= 1)
        model.add(sum(x[e, g] for g in range(G)) <= max_replicas)
    hint_f = np.zeros((E, G), dtype=np.int64)
    hint_f[hint_phy2log_P, gpu_P] = hint_share_P
    add = _add_weighted_shares if dispatch == "weighted" else _add_even_shares
    share = add(model, x, load_E, hint_f, np.bincount(hint_phy2log_P, minlength=E), max_replicas)
    assert int(hint_f.sum(axis=0).max()) == hint_z, "hint out of step with its objective"
    # The busiest GPU's load is at least the analytic lower bound, and no worse than the hint.
    z = model.new_int_var(min(lower, hint_z), hint_z, "max_gpu_load")
    model.add_hint(z, hint_z)
    for g in range(G):
        # No GPU serves more tokens than the busiest GPU's load.
        model.add(sum(share[e, g] for e in range(E)) <= z)
    model.minimize(z)
    return model, x, z


def _add_weighted_shares(model, x, load_E, hint_f, hint_count_E, max_replicas: int) -> dict:
    """Free integer shares f[e, g]: an expert's replicas serve all its tokens between them."""
    E, G = hint_f.shape
    share = {}
    for e in range(E):
        for g in range(G):
            share[e, g] = model.new_int_var(0, int(load_E[e]), f"f[{e},{g}]")
            model.add_hint(share[e, g], int(hint_f[e, g]))
            # A GPU serves tokens of an expert only if it holds a replica of it.
            model.add(share[e, g] <= int(load_E[e]) * x[e, g])
        model.add(sum(share[e, g] for g in range(G)) == int(load_E[e]))
    return share


def _add_even_shares(model, x, load_E, hint_f, hint_count_E, max_replicas: int) -> dict:
    """Even shares: every replica of e serves ceil(load_e / r_e), r_e its replica count."""
    E, G = hint_f.shape
    share = {}
    for e in range(E):
        le = int(load_E[e])
        # per_replica[e] = ceil(load_e / r_e): table entry k is for k replicas (k = 0 unused).
        table = [le] + [-(-le // k) for k in range(1, max_replicas + 1)]
        r = model.new_int_var(1, max_replicas, f"r[{e}]")
        per = model.new_int_var(min(table), le, f"per_replica[{e}]")
        model.add_hint(r, int(hint_count_E[e]))
        model.add_hint(per, table[hint_count_E[e]])
        # The number of replicas of an expert is the number of GPUs that hold it.
        model.add(sum(x[e, g] for g in range(G)) == r)
        # Each replica of an expert serves an even share of its load.
        model.add_element(r, table, per)
        for g in range(G):
            share[e, g] = model.new_int_var(0, le, f"c[{e},{g}]")
            model.add_hint(share[e, g], int(hint_f[e, g]))
            # A GPU that holds the expert serves at least that share. (Only a lower bound is
            # needed: shares appear only in "GPU load <= z", which z minimises, so at the
            # optimum c = per_replica where x = 1 and 0 elsewhere; one linear row each.)
            model.add(share[e, g] >= per - le + le * x[e, g])
    return share
