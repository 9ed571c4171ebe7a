"""Reference twin of the share-keeping repair's search step (eplb/migration/_repair_kernel.py),
kept as a test oracle: the numpy `_best_swap` eplb.migration.rule ran before it was compiled.

Legend: E = logical experts, G = GPUs, P = slots of one layer.
"""

from __future__ import annotations

import numpy as np


def _best_swap(phy_P, x_P, move_P, old_GE, gpu_P, node_P, G: int):
    """The swap between a slot of the busiest GPU and a slot of another GPU that lowers the
    busiest GPU most per move, or None.

    Returns (gain, moves, a, b): gain = the busiest load - the larger of the two GPUs' loads
    after it (> 0), moves = change in copies against the served placement (old_GE). Swaps
    that copy nothing (moves <= 0) come first, by gain.
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
