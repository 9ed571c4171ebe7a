"""Compiled search step of the share-keeping repair (numba): `eplb.migration.rule._best_swap`.

Legend: E = logical experts, G = GPUs, P = slots of one layer. Slot p lives on GPU gpu_P[p].

One layer's best swap between a slot of the busiest GPU and a slot of another GPU, as the numpy
step (tests/oracles/repair.py) chooses it: GPU loads summed in slot order (np.bincount's),
the busiest the first of the largest, the same gain and moves for every pair, and the pick
the first best ratio gain / max(moves, 1) in (source slot, target slot) order among the swaps
that copy nothing, else among all allowed ones. It trusts its input (rule.repair_swaps makes it).
"""

from __future__ import annotations

import numpy as np

from eplb.core.jit import kernel


@kernel
def best_swap(phy_P, x_P, move_P, old_GE, gpu_P, node_P, G):
    """(found, gain, moves, a, b) of the layer's best swap (found False: none lowers the busiest GPU)."""
    P = phy_P.shape[0]
    E = 0
    for p in range(P):
        if phy_P[p] + 1 > E:
            E = phy_P[p] + 1
    g_G = np.zeros(G)
    for p in range(P):
        g_G[gpu_P[p]] += x_P[p]
    top = 0
    for g in range(1, G):
        if g_G[g] > g_G[top]:
            top = g
    holds = np.zeros((G, E), dtype=np.bool_)
    for p in range(P):
        holds[gpu_P[p], phy_P[p]] = True
    peak = g_G[top]
    found = False
    free = False
    best = -np.inf
    best_gain = 0.0
    best_moves = 0
    best_a = -1
    best_b = -1
    for a in range(P):
        if gpu_P[a] != top:
            continue
        ea = phy_P[a]
        for b in range(P):
            gb = gpu_P[b]
            if gb == top:
                continue
            eb = phy_P[b]
            d = x_P[a] - x_P[b]
            gain = peak - max(peak - d, g_G[gb] + d)
            if not (gain > 0 and not holds[gb, ea] and not holds[top, eb]):
                continue
            same_node = node_P[a] == node_P[b]
            if not (move_P[a] == 2 or (move_P[a] == 1 and same_node)):
                continue
            if not (move_P[b] == 2 or (move_P[b] == 1 and same_node)):
                continue
            moves = ((not old_GE[gb, ea]) + (not old_GE[top, eb])) - ((not old_GE[top, ea]) + (not old_GE[gb, eb]))
            is_free = moves <= 0
            if free and not is_free:
                continue  # a swap that copies nothing is in hand: copying ones are out
            value = gain / max(moves, 1)
            if (is_free and not free) or value > best:
                free = free or is_free
                found = True
                best = value
                best_gain = gain
                best_moves = moves
                best_a = a
                best_b = b
    return found, best_gain, best_moves, best_a, best_b

