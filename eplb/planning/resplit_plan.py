"""A plan for an engine that re-splits every batch: the front door's plan, searched under the
re-split score (eplb.planning.resplit_repair), on the planning trace's own windows.

Legend: M = windows, L = MoE layers, E = logical experts, G = GPUs, P = physical slots.

Rules that re-split each batch (`RESPLIT_RULES`: eplb's `resplit`, the exact `optimal`, SGLang's
`lp`) serve a window as well as the best flow of each expert's tokens onto its replicas' GPUs
allows, so what a plan for them must balance is that optimum (`resplit_imbalance`), not the even
split the planners pack for. `search_solution` takes the planner's Solution (the front door's
`plan` calls it, through `eplb.planning.plan_for_resplit`, for every re-split rule) and:
1. from scratch: searches the planner's plan (`resplit_repair`, PLAN_ROUNDS passes, the windows
   and their widened deviations as scenarios);
   with a placement in force: searches both it and the planner's plan (relabelled onto it by the
   front door) with a price of `Budget.move_cost` per move, and keeps per layer the cheaper of
   keeping, repairing and re-planning, net of its moves; `max_moves` / `max_moves_per_gpu` then
   admit the changed layers by gain per move while they fit;
2. keeps a layer's new map only where its score on the trace's own windows (half the mean, half
   the worst window; `window_scores`: the exact optimum, or SGLang's `lp` itself) is below the
   start's (the plan, or the placement in force), so the result is never worse there than the
   even-split plan it started from.
SGLang's `lp` solves the same LP inexactly, and at start-up from a map most ranks keep their
tokens on a nearest replica (eplb.dispatch.sglang_lp): the search aims at the optimum, step 2
judges each layer under the rule itself.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from eplb.core.files import MAX_INPUT_ENV, format_size, max_input_bytes
from eplb.core.placement import Placement
from eplb.core.topology import Topology
from eplb.dispatch.resplit_score import layout, resplit_imbalance
from eplb.dispatch.rules import OptimalSplit, Resplit
from eplb.dispatch.sglang_lp import SglangLp
from eplb.errors import EplbError
from eplb.migration import Budget, count_moves
from eplb.planning.resplit_repair import PLAN_ROUNDS, resplit_repair
from planners.api import Solution

RESPLIT_RULES = (Resplit, OptimalSplit, SglangLp)
"""Rules that split each batch by its own counts over an expert's replicas."""

BYTES_PER_ENTRY = 8 * 12
"""Memory the re-split search and score take per (scenario, layer, flexible slot) entry: float64
GPU loads and flows, their copies and sort buffers (a dozen arrays of that size at the peak)."""


def re_splits(rule) -> bool:
    """Does `rule` re-split every batch over each expert's replicas (plan with `plan_for_resplit`)?"""
    return isinstance(rule, RESPLIT_RULES)


def check_resplit_size(phy2log_LP: np.ndarray, num_windows: int, num_gpus: int) -> None:
    """Refuse, before allocating, a re-split search or score whose arrays exceed the input limit."""
    lay = layout(phy2log_LP, num_gpus)
    L = len(phy2log_LP)
    R, X = lay.gpu_BRX.shape[1], lay.gpu_BRX.shape[2]
    # Scenarios: each window and its widened copy (resplit_repair's two spreads).
    need = BYTES_PER_ENTRY * 2 * num_windows * L * (R * X + num_gpus + 1)
    limit = max_input_bytes()
    if need > limit:
        raise EplbError(f"the re-split score of {num_windows} windows x {L} layers on {num_gpus} GPUs ({R} experts "
                        f"of a layer spanning up to {X} GPUs) would take {format_size(need)}, more than the limit of "
                        f"{format_size(limit)} ({MAX_INPUT_ENV}): plan on fewer windows (--aggregate window "
                        f"--window K, or a shorter trace), or raise {MAX_INPUT_ENV}")


def window_scores(rule, phy2log_LP: np.ndarray, windows_MLE: np.ndarray, topology, layer_ids=None) -> np.ndarray:
    """Busiest / mean GPU of each window and layer when `rule` serves the map, [M, L] (idle layers 1):
    the exact re-split optimum for `resplit` and `optimal`, the rule itself for SGLang's `lp`
    (its inexact solve, and at start-up the ranks that keep their tokens on a nearest replica)."""
    G = topology.num_gpus
    if not isinstance(rule, SglangLp):
        return resplit_imbalance(phy2log_LP, windows_MLE, G)
    pl = Placement(phy2log_LP, G, windows_MLE.shape[2], topology.num_nodes, layer_ids)
    bound = rule.bind(pl)
    out = np.ones(windows_MLE.shape[:2])
    for m, w_LE in enumerate(windows_MLE):
        mean_L = w_LE.sum(axis=1) / G
        busy_L = pl.gpu_loads(w_LE, bound(w_LE)).max(axis=1)
        out[m] = np.where(mean_L > 0, busy_L / np.where(mean_L > 0, mean_L, 1.0), 1.0)
    return out


def _cost(imb_ML: np.ndarray) -> np.ndarray:
    """Half the mean, half the worst window, [L]."""
    return 0.5 * imb_ML.mean(axis=0) + 0.5 * imb_ML.max(axis=0)


def _capped(old_LP, new_LP, gain_L, G, E, budget: Budget) -> np.ndarray:
    """new_LP with only the changed layers that fit max_moves / max_moves_per_gpu, taken by gain per move."""
    moves_LG = count_moves(old_LP, new_LP, G, E)
    if budget.max_moves is None and budget.max_moves_per_gpu is None:
        return new_LP
    out = old_LP.copy()
    total, per_gpu = 0, np.zeros(G, dtype=np.int64)
    changed = np.flatnonzero(moves_LG.sum(axis=1) > 0)
    for l in changed[np.argsort(-gain_L[changed] / moves_LG[changed].sum(axis=1), kind="stable")]:
        m_G = moves_LG[l]
        if budget.max_moves is not None and total + m_G.sum() > budget.max_moves:
            continue
        if budget.max_moves_per_gpu is not None and (per_gpu + m_G).max() > budget.max_moves_per_gpu:
            continue
        out[l], total, per_gpu = new_LP[l], total + int(m_G.sum()), per_gpu + m_G
    return out


def search_solution(sol: Solution, topology: Topology, rule, layer_ids, history_TLE, previous=None,
                    budget: Budget | None = None, rounds: int = PLAN_ROUNDS) -> Solution:
    """`sol` (a plan for `rule`, one of RESPLIT_RULES, already adapted to `previous`) with its map
    searched for the re-split rule on the windows history_TLE [M, L, E] (module docstring);
    info["resplit"] says what it did. `eplb.planning.plan_for_resplit` is the PlanResult form."""
    windows = np.asarray(history_TLE, dtype=np.float64)
    G, E = topology.num_gpus, windows.shape[2]
    plan_LP = np.asarray(sol.phy2log_LP, dtype=np.int64)
    check_resplit_size(plan_LP, len(windows), G)

    def cost(phy_LP):
        return _cost(window_scores(rule, phy_LP, windows, topology, layer_ids))

    if isinstance(rule, SglangLp):  # SGLang may refuse the shape: say so before the search
        rule.bind(Placement(plan_LP, G, E, topology.num_nodes, layer_ids))
    if previous is None:
        start_LP, price = plan_LP, 0.0
        new_LP = resplit_repair(plan_LP, windows, G, rounds=rounds)[0]
    else:
        budget = budget or Budget()
        start_LP, price = previous.phy2log_LP, float(budget.move_cost)
        # Step 1: repair the placement in force, and the planner's plan relabelled onto it.
        kept_LP, kept_L2 = resplit_repair(start_LP, windows, G, price=price, rounds=rounds)
        fresh_LP, fresh_L2 = resplit_repair(plan_LP, windows, G, price=price, rounds=rounds)
        net = [kept_L2[:, 0]]
        for cand_LP, cost_L2 in ((kept_LP, kept_L2), (fresh_LP, fresh_L2)):
            net.append(cost_L2[:, 1] + price * count_moves(start_LP, cand_LP, G, E).sum(axis=1))
        pick_L = np.argmin(np.stack(net), axis=0)
        new_LP = np.choose(pick_L[:, None], [start_LP, kept_LP, fresh_LP])
        new_LP = _capped(start_LP, new_LP, net[0] - np.min(np.stack(net), axis=0), G, E, budget)
    # Step 2: a layer's search is kept only where its score on the trace's windows, under the
    # rule that serves it, improves (SGLang's lp at start-up serves the optimum's map worse).
    start_L, new_L = cost(start_LP), cost(new_LP)
    moves_L = count_moves(start_LP, new_LP, G, E).sum(axis=1)
    better_L = new_L + price * moves_L < start_L - 1e-12
    out_LP = np.where(better_L[:, None], new_LP, start_LP)
    final_L = np.where(better_L, new_L, start_L)
    info = {**sol.info, "resplit": {
        "rounds": int(rounds), "windows": int(len(windows)), "layers_changed": int(better_L.sum()),
        "start": "previous" if previous is not None else "plan", "price": price,
        "score_start": float(np.median(start_L)), "score": float(np.median(final_L))}}
    message = (sol.message + "; " if sol.message else "") + \
        f"searched for the re-split rule on {len(windows)} window(s), {int(better_L.sum())} layer(s) changed"
    sol = replace(sol, phy2log_LP=out_LP, dispatch_weights_LP=None, info=info, message=message)
    if previous is not None:
        moves_LG = count_moves(previous.phy2log_LP, out_LP, G, E)
        mig = dict(sol.info.get("migration") or {})
        mig.update(moves=int(moves_LG.sum()), moves_max_per_gpu=int(moves_LG.sum(axis=0).max()),
                   method=(mig.get("method", "") + "+resplit").lstrip("+"))
        if mig.get("bytes") is not None and budget.bytes_per_expert is not None:
            mig["bytes"] = int(moves_LG.sum()) * int(budget.bytes_per_expert)
        sol = replace(sol, info={**sol.info, "migration": mig})
    return sol
