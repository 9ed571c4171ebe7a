"""Compiled packing of the rule-aware planner (numba): `planners.rule_aware._pack_numpy`, Step 4.

Legend: L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU, P = G x S slots,
U = units (nodes when N > 1, else GPUs), Q = G / U GPUs per unit, T = history windows,
I = P replicas of a layer, in packing order (heaviest first). Slot p lives on GPU p // S.

Per layer, each replica in turn goes to the allowed GPU with a free slot whose cost
max_t(load_gt + w_t) + 1e-12 sum_t load_gt is lowest (the first such GPU on a tie, as
np.argmin takes the first minimum). The sum over windows is added in numpy's order
(`planners._robust_kernel._pairwise`), so costs, and so every choice, agree with numpy's to
the bit. Allowed: a replicated expert's own unit; a single replica any unit with a free slot
left after the replicated experts still to come to it. With held (the served placement) a
GPU that holds the expert already is taken when its cost stays within the layer's cap.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from planners._robust_kernel import _pairwise

__all__ = ["pack_layers", "warm_up"]


@njit(cache=True, nogil=True)
def pack_layers(w_LIT, e_LI, u_LI, pending_LU, held_LGE, cap_L, use_held, S, phy_LP, bound_LP):
    """Pack every layer into phy_LP (int64 [L, P]) and bound_LP (bool [L, P], True where the
    slot holds a replicated expert's replica), in place.

    w_LIT: float64 [L, I, T], each replica's load per window; e_LI / u_LI: int64 [L, I], its
    expert and unit (-1: a single replica); pending_LU: int64 [L, U], replicated replicas per
    unit; held_LGE: bool [L, G, E] and cap_L: float64 [L], used when use_held. Returns the
    first layer that ran out of slots, or -1 (the planner asserts it never does).
    """
    L, I, T = w_LIT.shape
    U = pending_LU.shape[1]
    G = phy_LP.shape[1] // S
    Q = G // U
    load = np.empty(G * T)
    fill_G = np.empty(G, dtype=np.int64)
    pending_U = np.empty(U, dtype=np.int64)
    room_U = np.empty(U, dtype=np.int64)
    ok_G = np.empty(G, dtype=np.bool_)
    cost_G = np.empty(G)
    for l in range(L):
        load[:] = 0.0
        fill_G[:] = 0
        for v in range(U):
            pending_U[v] = pending_LU[l, v]
        for i in range(I):
            e = e_LI[l, i]
            u = u_LI[l, i]
            if u >= 0:
                for g in range(G):
                    ok_G[g] = g // Q == u
                pending_U[u] -= 1
            else:
                for v in range(U):
                    r = -pending_U[v]
                    for g in range(v * Q, (v + 1) * Q):
                        r += S - fill_G[g]
                    room_U[v] = r
                for g in range(G):
                    ok_G[g] = room_U[g // Q] > 0
            for g in range(G):
                if not (ok_G[g] and fill_G[g] < S):
                    ok_G[g] = False
                    continue
                o = g * T
                m = load[o] + w_LIT[l, i, 0]
                for t in range(1, T):
                    x = load[o + t] + w_LIT[l, i, t]
                    if x > m:
                        m = x
                cost_G[g] = m + 1e-12 * _pairwise(load, o, T, 1)
            if use_held:
                kept = False
                for g in range(G):
                    if ok_G[g] and held_LGE[l, g, e] and cost_G[g] <= cap_L[l]:
                        kept = True
                        break
                if kept:
                    for g in range(G):
                        ok_G[g] = ok_G[g] and held_LGE[l, g, e] and cost_G[g] <= cap_L[l]
            best = np.inf
            at = -1
            for g in range(G):
                if ok_G[g] and cost_G[g] < best:
                    best = cost_G[g]
                    at = g
            if at < 0:
                return l
            slot = at * S + fill_G[at]
            phy_LP[l, slot] = e
            bound_LP[l, slot] = u >= 0
            fill_G[at] += 1
            o = at * T
            for t in range(T):
                load[o + t] += w_LIT[l, i, t]
    return -1


def warm_up() -> None:
    """Run the kernel once on tiny inputs of the argument types the real calls use (loads it
    from numba's cache, or compiles it into the cache)."""
    w = np.ones((1, 4, 2))
    e = np.array([[0, 0, 1, 2]], dtype=np.int64)
    u = np.array([[0, 1, -1, -1]], dtype=np.int64)
    pending = np.array([[1, 1]], dtype=np.int64)
    held = np.zeros((1, 2, 3), dtype=np.bool_)
    pack_layers(w, e, u, pending, held, np.zeros(1), True, 2, np.empty((1, 4), dtype=np.int64),
                np.zeros((1, 4), dtype=np.bool_))
