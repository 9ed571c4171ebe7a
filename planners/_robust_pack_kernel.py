"""Compiled packing of the robust planners (numba): `planners.robust`'s `pack_vector`.

Legend: L = MoE layers, E = logical experts, P = physical slots, T = history windows, G = GPUs,
S = P / G slots per GPU, I = replicas of a packing round (= G). Slot p lives on GPU p // S.

S rounds, each an assignment of G replicas to the G GPUs (`_assign`: the algorithm of scipy's
linear_sum_assignment with its tie rules, so the pairing is scipy's); with one window, a round
pairs in a seeded GPU order (`_assign_in_order`). `planners._robust_kernel` re-exports
`pack_vector` and warms it up with the swap search. No function here recurses: numba's cache
cannot load recursive functions.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _assign(cost_IG, col_I, u_I, v_G, short_G, path_G, row_G, seen_I, seen_G, left_G):
    """Minimum-cost perfect assignment of a square cost matrix into col_I (row i -> column
    col_I[i]): shortest augmenting paths with dual potentials (Jonker-Volgenant, as Crouse
    describes it and scipy's linear_sum_assignment implements it, down to its tie rules: the
    columns are scanned from the last, and among equally short paths an unassigned column ends
    the search), so the pairing equals scipy's. Returns False when no finite pairing exists."""
    n = cost_IG.shape[0]
    for i in range(n):
        u_I[i] = 0.0
        col_I[i] = -1
    for j in range(n):
        v_G[j] = 0.0
        row_G[j] = -1
    for cur in range(n):
        for j in range(n):
            short_G[j] = np.inf
            path_G[j] = -1
            seen_G[j] = False
            left_G[j] = n - j - 1
        for i in range(n):
            seen_I[i] = False
        num_left = n
        low = 0.0
        i = cur
        sink = -1
        while sink < 0:
            seen_I[i] = True
            best = np.inf
            at = -1
            for it in range(num_left):
                j = left_G[it]
                r = low + cost_IG[i, j] - u_I[i] - v_G[j]
                if r < short_G[j]:
                    path_G[j] = i
                    short_G[j] = r
                if short_G[j] < best or (short_G[j] == best and row_G[j] == -1):
                    best = short_G[j]
                    at = it
            low = best
            if low == np.inf:
                return False
            j = left_G[at]
            if row_G[j] == -1:
                sink = j
            else:
                i = row_G[j]
            seen_G[j] = True
            num_left -= 1
            left_G[at] = left_G[num_left]
        u_I[cur] += low
        for i in range(n):
            if seen_I[i] and i != cur:
                u_I[i] += low - short_G[col_I[i]]
        for j in range(n):
            if seen_G[j]:
                v_G[j] -= low - short_G[j]
        j = sink
        while True:
            i = path_G[j]
            row_G[j] = i
            k = col_I[i]
            col_I[i] = j
            j = k
            if i == cur:
                break
    return True


@njit(cache=True, nogil=True)
def _assign_in_order(order_G, items_I, holds, col_I, taken_G):
    """One window: the items each take the first GPU of order_G left that does not hold their
    expert, into col_I, as `planners.robust._assign_in_order`. Returns False when an item
    finds no such GPU (which packing order rules out)."""
    G = order_G.shape[0]
    for g in range(G):
        taken_G[g] = False
    first = 0  # every GPU before it in order_G is taken
    for i in range(items_I.shape[0]):
        e = items_I[i]
        while first < G and taken_G[order_G[first]]:
            first += 1
        found = -1
        for j in range(first, G):
            g = order_G[j]
            if not taken_G[g] and not holds[g, e]:
                found = g
                break
        if found < 0:
            return False
        taken_G[found] = True
        col_I[i] = found
    return True


@njit(cache=True, nogil=True)
def pack_vector(w_LET, rep_LP, order_LSG, G, S, forbidden):
    """`planners.robust.pack_vector`'s rounds: phy2log int64 [L, P] from per-replica loads
    w_LET (float64 [L, E, T]) and the replicas in packing order rep_LP (int64 [L, P]); round k
    assigns rep_LP[l, kG:(k + 1)G] to the G GPUs at least cost (the GPU's worst window after
    it; `forbidden` for a GPU that holds the expert). With one window (T = 1) round k of layer
    l pairs in the GPU order order_LSG[l, k] (int64 [L, S, G]; unread when T > 1) instead of
    solving the assignment. Returns (phy, ok): ok False when a round had no
    feasible pairing."""
    L, E, T = w_LET.shape
    P = G * S
    phy = np.empty((L, P), dtype=np.int64)
    load_GT = np.empty((G, T))
    holds = np.empty((G, E), dtype=np.bool_)
    cost = np.empty((G, G))
    col_I = np.empty(G, dtype=np.int64)
    u_I = np.empty(G)
    v_G = np.empty(G)
    short_G = np.empty(G)
    path_G = np.empty(G, dtype=np.int64)
    row_G = np.empty(G, dtype=np.int64)
    seen_I = np.empty(G, dtype=np.bool_)
    seen_G = np.empty(G, dtype=np.bool_)
    left_G = np.empty(G, dtype=np.int64)
    for l in range(L):
        load_GT[:, :] = 0.0
        holds[:, :] = False
        for k in range(S):
            items_I = rep_LP[l, k * G:(k + 1) * G]
            # One window: every feasible pairing costs the same sum (planners.robust.pack_vector).
            if T == 1:
                if not _assign_in_order(order_LSG[l, k], items_I, holds, col_I, seen_G):
                    return phy, False
            else:
                for i in range(G):
                    e = items_I[i]
                    for g in range(G):
                        if holds[g, e]:
                            cost[i, g] = forbidden
                            continue
                        m = load_GT[g, 0] + w_LET[l, e, 0]
                        for t in range(1, T):
                            x = load_GT[g, t] + w_LET[l, e, t]
                            if x > m:
                                m = x
                        cost[i, g] = m
                if not _assign(cost, col_I, u_I, v_G, short_G, path_G, row_G, seen_I, seen_G, left_G):
                    return phy, False
                for i in range(G):
                    if cost[i, col_I[i]] >= forbidden:
                        return phy, False
            for i in range(G):
                g = col_I[i]
                e = items_I[i]
                phy[l, g * S + k] = e
                holds[g, e] = True
                for t in range(T):
                    load_GT[g, t] += w_LET[l, e, t]
    return phy, True
