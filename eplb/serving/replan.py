"""A fresh plan offered to the layers a few swaps cannot follow: the adaptive policy's replan on
a switch (eplb.serving.adaptive), with the bounds that keep it cheap.

Legend: M = windows, L = MoE layers (n: the layers handled), E = logical experts, G = GPUs,
P = physical slots.
"""

from __future__ import annotations

import numpy as np

from eplb.migration import count_moves
from eplb.migration.moves import fewest_moves
from eplb.serving.repair import normalise, renamed, replica_counts, window_imbalance
from planners.greedy import REFINE_GAP, plan_greedy, replicate


def replan(placement, old_LP, windows, w_M, new_LP, cost_L2, moves_LG, price, check_L, gap):
    """Offer a fresh greedy plan of the windows' (weighted) sum to the layers of check_L the
    repair leaves far (> gap) above it; it replaces the repair where its net gain (gain -
    price x moves) is higher. old_LP: the layers' rows in force, [n, P]; windows [M, n, E],
    weighted w_M [M]. Returns (new_LP, cost_L2, moves_LG), changed rows only."""
    G, E, P = placement.num_gpus, placement.num_logical_experts, placement.num_slots
    total_LE = (windows * w_M[:, None, None]).sum(axis=0)
    # Greedy's replica counts bound its plan from below, before it is made: in each window
    # the busiest GPU holds at least the mean load and each expert's share per replica, and
    # each replica an expert gains lands on a GPU that did not hold it (a move). Only the
    # layers where the plan could still be far from the repair and pay for its moves are
    # planned.
    count_LE = replicate(total_LE, P, G)
    per_ML = np.maximum(1.0, (normalise(windows, G) / count_LE).max(axis=2))
    bound_L = 0.5 * np.average(per_ML, axis=0, weights=w_M) + 0.5 * per_ML.max(axis=0)
    net_rep_L = cost_L2[:, 0] - cost_L2[:, 1] - price * moves_LG.sum(axis=1)
    gained_L = np.maximum(count_LE - replica_counts(old_LP, E), 0).sum(axis=1)
    cand = np.flatnonzero(check_L & (bound_L < cost_L2[:, 1] - gap)
                          & (cost_L2[:, 0] - bound_L - price * gained_L > np.maximum(net_rep_L, 0.0)))
    if not cand.size:
        return new_LP, cost_L2, moves_LG
    fresh_LP, cost_L = fresh_plan(placement, windows, w_M, total_LE, count_LE, cand)
    # The same test with the plan's own cost in place of the bound on it, and its moves bounded
    # by what any renaming could keep (`fewest_moves`; at least every replica gained, as
    # greedy never puts two replicas of an expert on one GPU): the renaming is made only where
    # the plan can still pay.
    moves_lb = np.maximum(gained_L[cand], fewest_moves(old_LP[cand], fresh_LP, G, E))
    far = (cost_L < cost_L2[cand, 1] - gap) \
        & (cost_L2[cand, 0] - cost_L - price * moves_lb > np.maximum(net_rep_L[cand], 0.0))
    cand, fresh_LP, cost_L = cand[far], fresh_LP[far], cost_L[far]
    if not cand.size:
        return new_LP, cost_L2, moves_LG
    rows_LP = renamed(old_LP[cand], fresh_LP, G, E, placement.num_nodes)
    rows_LG = count_moves(old_LP[cand], rows_LP, G, E)
    take = cost_L2[cand, 0] - cost_L - price * rows_LG.sum(axis=1) > np.maximum(net_rep_L[cand], 0.0)
    if not take.any():
        return new_LP, cost_L2, moves_LG
    new_LP, cost_L2, moves_LG = new_LP.copy(), cost_L2.copy(), moves_LG.copy()
    layers = cand[take]
    new_LP[layers] = rows_LP[take]
    cost_L2[layers, 1] = cost_L[take]
    moves_LG[layers] = rows_LG[take]
    return new_LP, cost_L2, moves_LG

def fresh_plan(placement, windows, w_M, total_LE, count_LE, layers):
    """A greedy plan of the windows' sum for `layers`, [n, P], and its cost on the windows
    (half the mean, weighted w_M, half the worst window of busiest / mean GPU), [n]. count_LE:
    greedy's replica counts of the sum (`replicate`, per layer), which the bound was made from."""
    fresh_LP = plan_greedy(total_LE[layers], placement.num_gpus, placement.slots_per_gpu,
                           count_LE=count_LE[layers], refine_gap=REFINE_GAP)
    busiest_ML = window_imbalance(fresh_LP, windows[:, layers], placement.num_gpus)
    return fresh_LP, 0.5 * np.average(busiest_ML, axis=0, weights=w_M) + 0.5 * busiest_ML.max(axis=0)
