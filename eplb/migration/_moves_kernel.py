"""Compiled counting and matching of `eplb.migration.moves` (numba).

Legend: L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU, P = G x S slots,
R = rows of S slots (one per layer and GPU).

- `count_moves`, `keep_slots`: per row of S slots (a GPU in one layer);
- `keep_counts`: the [L, G, G] overlap matrix `relabel` assigns on;
- `gpu_assignment`: the per-layer GPU (and node) matching, a Hungarian method;
- `rename_gpus`, `match_gpus`, `fewest_moves`: the greedy GPU matching a fresh plan is renamed
  by onto the placement in force (`moves.rename_gpus`), and the bound on any renaming's moves.

Every kernel trusts its inputs (no bounds checks): the callers validate maps first
(`eplb.migration.checks`). All release the GIL, so a serving thread keeps running while a side
thread plans. The numpy / scipy references the tests compare them with are in
tests/oracles/migration.py.
"""

from __future__ import annotations

import numpy as np

from eplb.core.jit import kernel


@kernel(error_model="numpy")
def _occurrence_keys(x, S, key):
    """key[j] = x[j] * S + (occurrences of x[j] before j), or -1 - j for an empty slot."""
    for j in range(S):
        if x[j] < 0:
            key[j] = -1 - j
            continue
        k = 0
        for i in range(j):
            if x[i] == x[j]:
                k += 1
        key[j] = x[j] * S + k


@kernel(error_model="numpy")
def keep_slots(old_RS, new_RS):
    """Compiled `migration.keep_slots` on rows of S slots (one row per layer and GPU): the
    within-row source slot of each old position, int64 [R, S]; same rules, same output."""
    R, S = new_RS.shape
    out = np.empty((R, S), dtype=np.int64)
    kn = np.empty(S, dtype=np.int64)
    ko = np.empty(S, dtype=np.int64)
    matched = np.empty(S, dtype=np.bool_)
    taken = np.empty(S, dtype=np.bool_)
    for r in range(R):
        _occurrence_keys(new_RS[r], S, kn)
        _occurrence_keys(old_RS[r], S, ko)
        for i in range(S):
            taken[i] = False
            out[r, i] = -1
        for j in range(S):
            matched[j] = False
            for i in range(S):
                if kn[j] == ko[i]:        # keys are unique in a row: at most one match
                    matched[j] = True
                    taken[i] = True
                    out[r, i] = j
                    break
        # Unmatched new slots fill the free positions, both in increasing order.
        i = 0
        for j in range(S):
            if matched[j]:
                continue
            while taken[i]:
                i += 1
            out[r, i] = j
            i += 1
    return out


@kernel(error_model="numpy")
def count_moves(old_RS, new_RS):
    """Compiled `migration.count_moves` on rows of S slots: experts (>= 0) a row of new_RS
    holds that its row of old_RS does not, each counted once, int64 [R]."""
    R, S = new_RS.shape
    out = np.zeros(R, dtype=np.int64)
    for r in range(R):
        for j in range(S):
            x = new_RS[r, j]
            if x < 0:
                continue
            seen = False
            for i in range(j):
                if new_RS[r, i] == x:
                    seen = True
                    break
            if seen:
                continue
            for i in range(S):
                if old_RS[r, i] == x:
                    seen = True
                    break
            if not seen:
                out[r] += 1
    return out


@kernel(error_model="numpy")
def keep_counts(old_LP, new_LP, G, E):
    """keep_LGG[l, a, b]: experts new GPU a holds that old GPU b held too (each counted once),
    float64 [L, G, G]; the overlap matrix `migration.relabel` assigns on."""
    L, P = new_LP.shape
    S = P // G
    out = np.zeros((L, G, G))
    old_EG = np.zeros((E, G), dtype=np.bool_)
    for l in range(L):
        for p in range(P):
            e = old_LP[l, p]
            if e >= 0:
                old_EG[e, p // S] = True
        for a in range(G):
            for j in range(S):
                x = new_LP[l, a * S + j]
                if x < 0:
                    continue
                seen = False
                for i in range(j):
                    if new_LP[l, a * S + i] == x:
                        seen = True
                        break
                if seen:
                    continue
                for b in range(G):
                    if old_EG[x, b]:
                        out[l, a, b] += 1.0
        for p in range(P):
            e = old_LP[l, p]
            if e >= 0:
                old_EG[e, p // S] = False
    return out


@kernel(error_model="numpy")
def keep_pairs(old_LP, new_LP, G, E):
    """The nonzero entries of keep_counts, layer by layer: (start_L1, a_M, b_M, w_M) with layer
    l's entries at start_L1[l]:start_L1[l + 1], new GPU a, old GPU b, experts kept w (int64).
    Each old GPU holding one of a's experts is visited once per expert, so the work is the
    replicas, not G x G per layer."""
    L, P = new_LP.shape
    S = P // G
    first = np.empty((L, E + 1), dtype=np.int64)   # old holders of e in layer l: gpus[l, first[l, e]:first[l, e + 1]]
    gpus = np.empty((L, P), dtype=np.int64)
    fill = np.empty(E, dtype=np.int64)
    cap = 0
    for l in range(L):
        for e in range(E + 1):
            first[l, e] = 0
        for p in range(P):
            e = old_LP[l, p]
            if e >= 0 and not _seen_before(old_LP, l, p, S):
                first[l, e + 1] += 1
        for e in range(E):
            first[l, e + 1] += first[l, e]
            fill[e] = first[l, e]
        for p in range(P):
            e = old_LP[l, p]
            if e >= 0 and not _seen_before(old_LP, l, p, S):
                gpus[l, fill[e]] = p // S
                fill[e] += 1
        for q in range(P):
            x = new_LP[l, q]
            if x >= 0:
                cap += first[l, x + 1] - first[l, x]      # at most one pair per visit
    a_M = np.empty(cap, dtype=np.int64)
    b_M = np.empty(cap, dtype=np.int64)
    w_M = np.empty(cap, dtype=np.int64)
    start = np.zeros(L + 1, dtype=np.int64)
    acc = np.zeros(G, dtype=np.int64)
    touched = np.empty(G, dtype=np.int64)
    m = 0
    for l in range(L):
        for a in range(G):
            nt = 0
            for j in range(S):
                q = a * S + j
                x = new_LP[l, q]
                if x < 0 or _seen_before(new_LP, l, q, S):
                    continue
                for k in range(first[l, x], first[l, x + 1]):
                    b = gpus[l, k]
                    if acc[b] == 0:
                        touched[nt] = b
                        nt += 1
                    acc[b] += 1
            for t in range(nt):
                b = touched[t]
                a_M[m] = a
                b_M[m] = b
                w_M[m] = acc[b]
                acc[b] = 0
                m += 1
        start[l + 1] = m
    return start, a_M[:m], b_M[:m], w_M[:m]


@kernel(error_model="numpy")
def _seen_before(phy_LP, l, p, S):
    """Does slot p's expert occur in an earlier slot of the same GPU (layer l)?"""
    for i in range(p - p % S, p):
        if phy_LP[l, i] == phy_LP[l, p]:
            return True
    return False


@kernel(error_model="numpy")
def _assign_max(w, r0, c0, n, u, v, p, way, minv, used, out):
    """Maximum-weight perfect matching of the n x n block w[r0:r0+n, c0:c0+n] (Hungarian
    method with potentials, O(n^3)); out[j] = row (0..n-1) matched to column j. Returns the
    matched weight. u, v, p, way, minv, used: scratch of n + 1 entries."""
    for j in range(n + 1):
        u[j] = 0.0
        v[j] = 0.0
        p[j] = 0
        way[j] = 0
    for i in range(1, n + 1):
        p[0] = i
        j0 = 0
        for j in range(n + 1):
            minv[j] = np.inf
            used[j] = False
        while True:
            used[j0] = True
            i0 = p[j0]
            delta = np.inf
            j1 = 0
            for j in range(1, n + 1):
                if not used[j]:
                    cur = -w[r0 + i0 - 1, c0 + j - 1] - u[i0] - v[j]
                    if cur < minv[j]:
                        minv[j] = cur
                        way[j] = j0
                    if minv[j] < delta:
                        delta = minv[j]
                        j1 = j
            for j in range(n + 1):
                if used[j]:
                    u[p[j]] += delta
                    v[j] -= delta
                else:
                    minv[j] -= delta
            j0 = j1
            if p[j0] == 0:
                break
        while True:
            j1 = way[j0]
            p[j0] = p[j1]
            j0 = j1
            if j0 == 0:
                break
    total = 0.0
    for j in range(1, n + 1):
        out[j - 1] = p[j] - 1
        total += w[r0 + p[j] - 1, c0 + j - 1]
    return total


@kernel(error_model="numpy")
def gpu_assignment(keep_LGG, num_nodes):
    """Compiled `migration._gpu_assignment`: out[l, b] = new GPU placed at old GPU b, int64
    [L, G]; the best GPU matching inside every (new node, old node) pair, then the best node
    matching (num_nodes = 1: one matching of all GPUs). Optimal like scipy's; ties may differ."""
    L, G, _ = keep_LGG.shape
    n = G // num_nodes
    m = max(n, num_nodes)
    u = np.empty(m + 1)
    v = np.empty(m + 1)
    p = np.empty(m + 1, dtype=np.int64)
    way = np.empty(m + 1, dtype=np.int64)
    minv = np.empty(m + 1)
    used = np.empty(m + 1, dtype=np.bool_)
    inner = np.empty((num_nodes, num_nodes, n), dtype=np.int64)
    node_keep = np.empty((num_nodes, num_nodes))
    node_of = np.empty(num_nodes, dtype=np.int64)
    out = np.empty((L, G), dtype=np.int64)
    for l in range(L):
        w = keep_LGG[l]
        for a in range(num_nodes):
            for b in range(num_nodes):
                node_keep[a, b] = _assign_max(w, a * n, b * n, n, u, v, p, way, minv, used, inner[a, b])
        if num_nodes == 1:
            node_of[0] = 0
        else:
            _assign_max(node_keep, 0, 0, num_nodes, u, v, p, way, minv, used, node_of)
        for b in range(num_nodes):
            a = node_of[b]
            for j in range(n):
                out[l, b * n + j] = a * n + inner[a, b, j]
    return out


@kernel(inline=True, error_model="numpy")
def _holders(old_LP, l, S, start_E, at_P, fill_E):
    """The old GPUs holding each expert of layer l, as compressed rows: expert e's are
    at_P[start_E[e]:start_E[e + 1]], in slot order (a GPU's entries adjacent); empty slots are
    skipped (with no bounds checks, a -1 would index another expert's row). fill_E: scratch."""
    P = old_LP.shape[1]
    E = fill_E.shape[0]
    start_E[:] = 0
    for p in range(P):
        if old_LP[l, p] >= 0:                 # an empty slot (-1) holds nothing
            start_E[old_LP[l, p] + 1] += 1
    for e in range(E):
        start_E[e + 1] += start_E[e]
    fill_E[:] = start_E[:E]
    for p in range(P):
        e = old_LP[l, p]
        if e >= 0:
            at_P[fill_E[e]] = p // S
            fill_E[e] += 1


@kernel(error_model="numpy")
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
            if e < 0:
                continue
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


@kernel(error_model="numpy")
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
                if e < 0 or _seen_before(new_LP, l, p, S):
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


@kernel(error_model="numpy")
def rename_gpus(old_LP, new_LP, num_gpus, num_logical_experts, out_LP):
    """new_LP with each layer's GPUs renamed by `match_gpus` and each GPU's slots ordered so that
    the replicas it keeps stay in their old slots (`keep_slots`' rule), into out_LP
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
