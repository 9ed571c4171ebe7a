"""Compiled renaming of a fresh plan onto the placement in force (numba): the adaptive policy's
replan (`eplb.serving.repair.renamed`) keeps as many of the served replicas in place as a greedy matching
of GPUs by shared experts gives.

Legend: L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU, P = G x S slots.

The GPUs of a fresh plan are interchangeable, and so are the slots of one GPU: `rename_gpus`
picks, per layer, which new GPU takes each old GPU's place (`match_gpus`), then orders each
GPU's slots so the replicas it keeps stay where they were (`eplb.migration.keep_slots`' rule).
Layers are independent: blocks of them run on threads (the kernels release the GIL). Compiled
with `cache=True` and loaded by `eplb.serving.repair.warm_up`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from eplb.migration._moves_kernel import keep_slots


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _holders(old_LP, l, S, start_E, at_P, fill_E):
    """The old GPUs holding each expert of layer l, as compressed rows: expert e's are
    at_P[start_E[e]:start_E[e + 1]], in slot order (a GPU's entries adjacent). fill_E: scratch."""
    P = old_LP.shape[1]
    E = fill_E.shape[0]
    start_E[:] = 0
    for p in range(P):
        start_E[old_LP[l, p] + 1] += 1
    for e in range(E):
        start_E[e + 1] += start_E[e]
    fill_E[:] = start_E[:E]
    for p in range(P):
        e = old_LP[l, p]
        at_P[fill_E[e]] = p // S
        fill_E[e] += 1


@njit(cache=True, nogil=True, error_model="numpy")
def match_gpus(old_LP, new_LP, num_gpus, num_logical_experts):
    """For each layer, the GPU of new_LP to put at each old GPU's position, int [L, G]: pairs
    of (new GPU, old GPU) sharing the most experts first, each GPU used once (a greedy
    matching: the GPUs of a fresh plan are interchangeable, and this renaming is what keeps its
    replicas in place; the optimal assignment keeps a few more for many times the time)."""
    L, P = old_LP.shape
    G = num_gpus
    E = num_logical_experts
    S = P // G
    out_LG = np.empty((L, G), dtype=np.int64)
    start_E = np.empty(E + 1, dtype=np.int64)
    at_P = np.empty(P, dtype=np.int64)
    fill_E = np.empty(E, dtype=np.int64)
    overlap_GG = np.zeros((G, G), dtype=np.int64)
    pair_h = np.empty(P * G, dtype=np.int64)
    pair_g = np.empty(P * G, dtype=np.int64)
    order = np.empty(P * G, dtype=np.int64)
    # Pairs by overlap, most first, in discovery order among equals (a stable counting sort: an
    # overlap is at most S x S, a GPU's slots against another's).
    start_V = np.empty(S * S + 2, dtype=np.int64)
    used_new = np.empty(G, dtype=np.bool_)
    used_old = np.empty(G, dtype=np.bool_)
    for l in range(L):
        _holders(old_LP, l, S, start_E, at_P, fill_E)
        n = 0
        for p in range(P):
            h = p // S
            e = new_LP[l, p]
            for i in range(start_E[e], start_E[e + 1]):
                g = at_P[i]
                if overlap_GG[h, g] == 0:
                    pair_h[n] = h
                    pair_g[n] = g
                    n += 1
                overlap_GG[h, g] += 1
        vmax = 0
        for i in range(n):
            vmax = max(vmax, overlap_GG[pair_h[i], pair_g[i]])
        start_V[:vmax + 2] = 0
        for i in range(n):
            start_V[vmax - overlap_GG[pair_h[i], pair_g[i]] + 1] += 1
        for v in range(vmax + 1):
            start_V[v + 1] += start_V[v]
        for i in range(n):
            k = vmax - overlap_GG[pair_h[i], pair_g[i]]
            order[start_V[k]] = i
            start_V[k] += 1
        used_new[:] = False
        used_old[:] = False
        out_LG[l] = -1
        for i in order[:n]:
            h, g = pair_h[i], pair_g[i]
            overlap_GG[h, g] = 0
            if not used_new[h] and not used_old[g]:
                used_new[h] = True
                used_old[g] = True
                out_LG[l, g] = h
        h = 0
        for g in range(G):
            if out_LG[l, g] < 0:
                while used_new[h]:
                    h += 1
                used_new[h] = True
                out_LG[l, g] = h
    return out_LG


@njit(cache=True, nogil=True, error_model="numpy")
def fewest_moves(old_LP, new_LP, num_gpus, num_logical_experts):
    """For each layer, a lower bound on the moves (`migration.count_moves`) of new_LP with its
    GPUs renamed in any way, int [L]: a new GPU keeps at most the experts it shares with the old
    GPU it shares most with, and moves the rest of its own (each expert counted once)."""
    L, P = old_LP.shape
    G = num_gpus
    E = num_logical_experts
    S = P // G
    out_L = np.zeros(L, dtype=np.int64)
    start_E = np.empty(E + 1, dtype=np.int64)
    at_P = np.empty(P, dtype=np.int64)
    fill_E = np.empty(E, dtype=np.int64)
    shared_G = np.zeros(G, dtype=np.int64)
    for l in range(L):
        _holders(old_LP, l, S, start_E, at_P, fill_E)
        for h in range(G):
            own = 0
            best = 0
            for p in range(h * S, (h + 1) * S):
                e = new_LP[l, p]
                if e < 0 or _seen_before(new_LP, l, h * S, p, e):
                    continue
                own += 1
                for i in range(start_E[e], start_E[e + 1]):
                    if i == start_E[e] or at_P[i] != at_P[i - 1]:
                        shared_G[at_P[i]] += 1
                        best = max(best, shared_G[at_P[i]])
            out_L[l] += own - best
            for p in range(h * S, (h + 1) * S):
                e = new_LP[l, p]
                if e >= 0:
                    for i in range(start_E[e], start_E[e + 1]):
                        shared_G[at_P[i]] = 0
    return out_L


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _seen_before(new_LP, l, lo, p, e):
    """Does a slot of the same GPU before slot p (from slot lo) hold expert e too?"""
    for q in range(lo, p):
        if new_LP[l, q] == e:
            return True
    return False


@njit(cache=True, nogil=True, error_model="numpy")
def rename_gpus(old_LP, new_LP, num_gpus, num_logical_experts, out_LP):
    """new_LP with each layer's GPUs renamed by `match_gpus` and each GPU's slots ordered so that
    the replicas it keeps stay in their old slots (`migration.keep_slots`' rule), into out_LP
    [L, P]: the whole renaming in one call, so blocks of layers run on threads without the GIL."""
    L, P = old_LP.shape
    G = num_gpus
    S = P // G
    src_LG = match_gpus(old_LP, new_LP, G, num_logical_experts)
    moved_RS = np.empty((L * G, S), dtype=np.int64)
    for l in range(L):
        for g in range(G):
            h = src_LG[l, g] * S
            for s in range(S):
                moved_RS[l * G + g, s] = new_LP[l, h + s]
    keep_RS = keep_slots(old_LP.reshape(L * G, S), moved_RS)
    for l in range(L):
        for g in range(G):
            for s in range(S):
                out_LP[l, g * S + s] = moved_RS[l * G + g, keep_RS[l * G + g, s]]
