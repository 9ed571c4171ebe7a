"""Compiled per-batch time dispatch (numba): eplb.dispatch.timed's three steps, one layer at a time.

Legend: L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU, P = G x S slots,
R = rows of the multi-GPU table (one per (layer, expert) on >= 2 GPUs, by layer, then colour,
then expert), X = most GPUs one expert is on.

`shares` is `TimeSolver.numpy` (the numpy reference it is tested against) as plain loops over
scalars: Step 1 (one-GPU experts keep their rows), Step 2 (each multi-GPU expert takes j of
its replicas, the colour's experts against the layer's busiest GPU as it stood when the colour
began, exactly as the numpy path decides a colour in one step), Step 3 (the even split where
it is modeled no worse, in the busiest GPU or in the whole step of `eplb.dispatch.cost.step_cost`:
expert compute, and the all-to-all expected under independent picks). Layers share nothing,
so a layer is finished before the next begins and its buffers are reused. The kernel trusts
its input (TimeSolver builds the tables and checks the counts) and releases the GIL.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _busy(n, overhead, stream, slope_mem, slope_cmp):
    """Modeled seconds of one replica with n rows (TimeSolver._seconds)."""
    if n > 0:
        return overhead + max(n * slope_cmp, stream + n * slope_mem)
    return 0.0


@njit(cache=True, nogil=True)
def _pick(n, b_X, x, lm, whole, c, amount_X, order_X, level_X, fixed_X, slope_X):
    """Rows for each of the x replicas with busy times b_X[:x] into amount_X[:x] (in their
    own order): all on the least busy, or water-filled over the j least busy (TimeSolver._options)."""
    overhead, stream, slope_mem, slope_cmp, knee = c[0], c[1], c[2], c[3], c[4]
    # Stable order of the replicas by busy time (insertion sort: x is a handful).
    for i in range(x):
        order_X[i] = i
    for i in range(1, x):
        k = order_X[i]
        j = i - 1
        while j >= 0 and b_X[order_X[j]] > b_X[k]:
            order_X[j + 1] = order_X[j]
            j -= 1
        order_X[j + 1] = k
    one = _busy(n, overhead, stream, slope_mem, slope_cmp)
    best_j = 0
    best = max(b_X[order_X[0]] + one, lm) + 1e-9 * one
    acc = 0.0
    for j in range(x):
        ks = j + 1.0
        if n / ks >= knee:                          # compute-bound rows per replica: no stream
            fixed, slope = overhead, slope_cmp
        else:
            fixed, slope = overhead + stream, slope_mem
        b = b_X[order_X[j]]
        acc += b + fixed
        level = (n * slope + acc) / ks
        fixed_X[j], slope_X[j], level_X[j] = fixed, slope, level
        if j == 0:
            continue
        touched = level if level >= b + fixed else np.inf
        key = max(touched, lm) + 1e-9 * (ks * fixed + n * slope)
        if key < best:
            best, best_j = key, j
    total = 0.0
    for j in range(x):
        amount = 0.0
        if best_j > 0 and j <= best_j:
            amount = max(level_X[best_j] - fixed_X[best_j] - b_X[order_X[j]], 0.0) / slope_X[best_j]
            if whole:
                amount = math.floor(amount + 1e-9)
        amount_X[order_X[j]] = amount
        total += amount
    amount_X[order_X[0]] += n - total               # j = 1, and the rounding of the level


@njit(cache=True, nogil=True)
def _layer_seconds(rows_P, G, S, per_node, B, c, comp_G, hit_G, node_N, log_T):
    """Modeled step of one layer from the rows of each slot (eplb.dispatch.cost.step_cost's layer_s_L,
    the all-to-all expected under independent picks). log_T: log(1 - n / B) by whole row
    count n, filled on first use (NaN until then); empty when the rows are not whole."""
    overhead, cmp, weight_bytes, row_bytes, hbm = c[0], c[3], c[5], c[6], c[7]
    d_bytes, c_bytes, nvlink, internode, latency, overlap = c[8], c[9], c[10], c[11], c[12], c[13]
    N = G // per_node
    denom = float(max(B, 1))
    for m in range(N):
        node_N[m] = 0.0
    for g in range(G):
        comp, log_miss = 0.0, 0.0
        for s in range(S):
            n = rows_P[g * S + s]
            if n > 0:                                   # an empty slot costs nothing and is never sent to
                comp += overhead + max(n * cmp, (weight_bytes + n * row_bytes) / hbm)
                k = int(n)
                if k < log_T.size:
                    if math.isnan(log_T[k]):
                        log_T[k] = math.log1p(-min(min(n / denom, 1.0), 1.0 - 1e-12))
                    log_miss += log_T[k]
                else:
                    log_miss += math.log1p(-min(min(n / denom, 1.0), 1.0 - 1e-12))
        comp_G[g] = comp
        hit_G[g] = -math.expm1(log_miss)
        node_N[g // per_node] += hit_G[g]
    total = 0.0
    for m in range(N):
        total += node_N[m]
    src = B / G
    comp_max, disp_max, comb_max = 0.0, -np.inf, -np.inf
    for g in range(G):
        comp_max = max(comp_max, comp_G[g])
        own = node_N[g // per_node]
        intra = max(src * (own - hit_G[g]), src * (per_node - 1) * hit_G[g])
        inter = max(src * (total - own), src * (G - per_node) * hit_G[g])
        disp = latency + max(intra * d_bytes / nvlink, inter * d_bytes / internode)
        comb = latency + max(intra * c_bytes / nvlink, inter * c_bytes / internode)
        disp_max, comb_max = max(disp_max, disp), max(comb_max, comb)
    comm = disp_max + comb_max
    return max(comp_max, comm) if overlap != 0.0 else comp_max + comm


@njit(cache=True, nogil=True)
def shares(counts_LE, whole, tokens, G, S, per_node, c, home_LE, multi_LE, phy2log_LP, count_LP, even_LP,
           rank_LP, first_LP, row_start_L, row_expert_R, row_colour_R, row_width_R, slot_RX, gpu_RX):
    """Shares [L, P] of each slot in its expert's rows for one batch's counts [L, E].

    c: float64 constants, [overhead s, weight stream s, HBM s per row, compute s per row, knee rows,
    weight bytes, HBM bytes per row, HBM bytes/s, dispatch bytes per token, combine bytes per token,
    NVLink bytes/s, inter-node bytes/s, all-to-all latency s, overlap (0 or 1)].
    """
    L, E = counts_LE.shape
    P = G * S
    X = slot_RX.shape[1]
    overhead, stream, slope_mem, slope_cmp = c[0], c[1], c[2], c[3]
    out_LP = np.empty((L, P))
    rows_P, even_P, busy_G = np.empty(P), np.empty(P), np.empty(G)
    comp_G, hit_G, node_N = np.empty(G), np.empty(G), np.empty(max(G // per_node, 1))
    b_X, amount_X, level_X, fixed_X, slope_X = np.empty(X), np.empty(X), np.empty(X), np.empty(X), np.empty(X)
    order_X = np.empty(X, dtype=np.int64)
    # Decode batches have few distinct row counts: each log(1 - n / B) is computed once.
    log_T = np.full(min(tokens, 4096) + 1 if whole else 0, np.nan)
    for l in range(L):
        # Step 1: experts on one GPU keep their rows at their home slot.
        rows_P[:] = 0.0
        busy_G[:] = 0.0
        for e in range(E):
            if not multi_LE[l, e]:
                n = counts_LE[l, e]
                rows_P[home_LE[l, e]] += n
                busy_G[home_LE[l, e] // S] += _busy(n, overhead, stream, slope_mem, slope_cmp)
        # Step 2: the multi-GPU experts, colour by colour (a colour's experts share no GPU).
        colour, lm = -1, 0.0
        for r in range(row_start_L[l], row_start_L[l + 1]):
            if row_colour_R[r] != colour:
                colour = row_colour_R[r]
                lm = busy_G[0]
                for g in range(1, G):
                    lm = max(lm, busy_G[g])
            n = counts_LE[l, row_expert_R[r]]
            x = row_width_R[r]
            first = 0
            for j in range(x):
                b_X[j] = busy_G[gpu_RX[r, j]]
                if b_X[j] < b_X[first]:
                    first = j
            if b_X[first] + _busy(n, overhead, stream, slope_mem, slope_cmp) > lm:
                _pick(n, b_X, x, lm, whole, c, amount_X, order_X, level_X, fixed_X, slope_X)
            else:                                     # all on the least busy leaves the layer's busiest as is
                amount_X[:x] = 0.0
                amount_X[first] = n
            for j in range(x):
                rows_P[slot_RX[r, j]] += amount_X[j]
                busy_G[gpu_RX[r, j]] += _busy(amount_X[j], overhead, stream, slope_mem, slope_cmp)
        # Step 3: the even split's rows (whole rows round-robin in slot order), second copies
        # on one GPU counted with the first.
        even_P[:] = 0.0
        for p in range(P):
            n, k = counts_LE[l, phy2log_LP[l, p]], count_LP[l, p]
            if k == 1 or n == 0.0:                  # most slots: the same value, without dividing
                v = n
            elif whole:
                base = math.floor(n / k)
                v = base + (1.0 if rank_LP[l, p] < n - base * k else 0.0)
            else:
                v = n / k
            even_P[first_LP[l, p]] += v
        time_max, even_max = busy_G[0], -np.inf
        for g in range(1, G):
            time_max = max(time_max, busy_G[g])
        for g in range(G):
            t = 0.0
            for s in range(S):
                t += _busy(even_P[g * S + s], overhead, stream, slope_mem, slope_cmp)
            even_max = max(even_max, t)
        worse = time_max > even_max * (1 + 1e-12)
        if not worse:
            worse = (_layer_seconds(rows_P, G, S, per_node, tokens, c, comp_G, hit_G, node_N, log_T)
                     > _layer_seconds(even_P, G, S, per_node, tokens, c, comp_G, hit_G, node_N, log_T) * (1 + 1e-12))
        for p in range(P):
            n, v = counts_LE[l, phy2log_LP[l, p]], rows_P[p]
            if worse or n <= 0:
                out_LP[l, p] = even_LP[l, p]
            else:                                   # 0 and all of an expert's rows need no division
                out_LP[l, p] = 0.0 if v == 0.0 else (1.0 if v == n else v / n)
    return out_LP
