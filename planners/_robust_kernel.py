"""Compiled packing and swap search of the robust planners (numba): `planners.robust`'s
`pack_vector` and `smooth_max_swaps`.

Legend: L = MoE layers, E = logical experts, P = physical slots, T = history windows, G = GPUs,
S = P / G slots per GPU, I = replicas of a packing round (= G). Slot p lives on GPU p // S.

- `pack_vector` (in `planners/_robust_pack_kernel.py`, re-exported here): S rounds, each an
  assignment of G replicas to the G GPUs, the pairing scipy's linear_sum_assignment makes;
- `smooth_max_swaps`: the search `planners.robust.smooth_max_swaps_numpy` specifies. Per layer,
  while a swap lowers Z = sum over kept windows and GPUs of exp(beta (load - peak)), the best
  swap of a slot on one of the top_gpus busiest GPUs with any slot elsewhere is made. Layers
  are independent, so each runs its own rounds to the end here (numpy moves all layers in
  lock-step; the swaps are the same). Gains use numpy's factored form; loads and sums of
  exponentials are added in numpy's order (`_pairwise`), the two products per window of a
  gain are summed with reassociation ("reassoc": it vectorises; numpy's matrix products round
  their own way), so the argmax picks numpy's swap unless two gains tie to ~1e-15. GPU pairs
  whose gain bound cannot beat the best swap so far are skipped (`_best_swap`); the gains of a
  GPU pair are computed for four of the source GPU's slots at a time (`_swap_costs`). A GPU
  pair the last swap did not change keeps the best swap it had when last scored: at the same
  peak that is its best swap now (the same to the bit), at another peak its gain, scaled,
  bounds the pair's gains now, so only the pairs that bound can still win are rescored.
Scratch arrays are reused across layers; `holds` is kept up to date on each swap, and a round
recomputes the loads and exponentials of the two GPUs the last swap changed only (of all GPUs
when the peak or the kept windows moved), by the same arithmetic, so to the bit. No
function here recurses: numba's cache cannot load recursive functions.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from planners._robust_pack_kernel import pack_vector

__all__ = ["pack_vector", "smooth_max_swaps", "warm_up"]

_TILE = 4
"""Slots of the source GPU whose swaps with a target GPU's slots are scored together: each
value of a target slot read then serves four products instead of one (the search is bound by
reads; more rows, or two target slots at a time, run out of registers)."""


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _swap_costs(x_RT, u_RT, v_PT, y_PT, o, S, n, c1_RS, c2_RS):
    """For source slots r < n (n <= _TILE) and the S slots b = o .. o + S - 1 of one GPU:
    c1_RS[r, s] = sum_t x_rt v_bt and c2_RS[r, s] = sum_t u_rt y_bt, the new smooth-max terms
    of the two GPUs of a swap. Only these sums may be reassociated (they vectorise); numpy's
    batched products round them their own way too. The two stay apart, as numpy's gain
    subtracts them one at a time (with one window, exact ties then break alike)."""
    T = x_RT.shape[1]
    if n < _TILE:  # the last rows of a GPU whose slots are not a multiple of the tile
        for r in range(n):
            for s in range(S):
                v_T = v_PT[o + s]
                y_T = y_PT[o + s]
                p = 0.0
                q = 0.0
                for t in range(T):
                    p += x_RT[r, t] * v_T[t]
                    q += u_RT[r, t] * y_T[t]
                c1_RS[r, s] = p
                c2_RS[r, s] = q
        return
    for s in range(S):
        v_T = v_PT[o + s]
        y_T = y_PT[o + s]
        p0 = 0.0
        p1 = 0.0
        p2 = 0.0
        p3 = 0.0
        q0 = 0.0
        q1 = 0.0
        q2 = 0.0
        q3 = 0.0
        for t in range(T):
            v = v_T[t]
            y = y_T[t]
            p0 += x_RT[0, t] * v
            p1 += x_RT[1, t] * v
            p2 += x_RT[2, t] * v
            p3 += x_RT[3, t] * v
            q0 += u_RT[0, t] * y
            q1 += u_RT[1, t] * y
            q2 += u_RT[2, t] * y
            q3 += u_RT[3, t] * y
        c1_RS[0, s] = p0
        c1_RS[1, s] = p1
        c1_RS[2, s] = p2
        c1_RS[3, s] = p3
        c2_RS[0, s] = q0
        c2_RS[1, s] = q1
        c2_RS[2, s] = q2
        c2_RS[3, s] = q3


@njit(cache=True, nogil=True)
def _block_sum(a, start, n, stride):
    """numpy's pairwise sum of at most 128 terms a[start + i stride]: in order below 8 terms,
    else eight running sums combined as a tree, then the remainder."""
    if n < 8:
        r = 0.0
        for i in range(n):
            r += a[start + i * stride]
        return r
    r0 = a[start]
    r1 = a[start + stride]
    r2 = a[start + 2 * stride]
    r3 = a[start + 3 * stride]
    r4 = a[start + 4 * stride]
    r5 = a[start + 5 * stride]
    r6 = a[start + 6 * stride]
    r7 = a[start + 7 * stride]
    i = 8
    while i < n - n % 8:
        o = start + i * stride
        r0 += a[o]
        r1 += a[o + stride]
        r2 += a[o + 2 * stride]
        r3 += a[o + 3 * stride]
        r4 += a[o + 4 * stride]
        r5 += a[o + 5 * stride]
        r6 += a[o + 6 * stride]
        r7 += a[o + 7 * stride]
        i += 8
    r = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        r += a[start + i * stride]
        i += 1
    return r


@njit(cache=True, nogil=True)
def _pairwise(a, start, n, stride):
    """sum of a[start + i stride], i < n, added in numpy's order for a contiguous reduction
    (blocks of 128 and below as `_block_sum`, larger runs split in halves of a multiple of 8
    terms), so that sums agree to the bit with the numpy search's and near-tied swaps are
    chosen alike. The halving runs on an explicit stack: numba's cache cannot load recursion."""
    if n <= 128:
        return _block_sum(a, start, n, stride)
    depth = 64
    f_start = np.empty(depth, dtype=np.int64)
    f_n = np.empty(depth, dtype=np.int64)
    f_stage = np.empty(depth, dtype=np.int64)   # 0: split next, 1: left half pending, 2: right half pending
    f_left = np.empty(depth)
    top = 0
    f_start[0] = start
    f_n[0] = n
    f_stage[0] = 0
    val = 0.0
    have = False  # val holds the sum of the frame just finished
    while True:
        if have:
            if top < 0:
                return val
            if f_stage[top] == 1:
                f_left[top] = val
                f_stage[top] = 2
                half = f_n[top] // 2
                half -= half % 8
                top += 1
                f_start[top] = f_start[top - 1] + half * stride
                f_n[top] = f_n[top - 1] - half
                f_stage[top] = 0
                have = False
            else:
                val = f_left[top] + val
                top -= 1
            continue
        if f_n[top] <= 128:
            val = _block_sum(a, f_start[top], f_n[top], stride)
            top -= 1
            have = True
            continue
        half = f_n[top] // 2
        half -= half % 8
        f_stage[top] = 1
        top += 1
        f_start[top] = f_start[top - 1]
        f_n[top] = half
        f_stage[top] = 0


@njit(cache=True, nogil=True)
def _kept(load_GT, keep, kept_T, peak_T):
    """kept_T[t]: window t is among the `keep` windows with the lowest peak (ties: lower index),
    as `planners.robust.kept_windows` with a stable sort; all windows when keep >= T."""
    G, T = load_GT.shape
    for t in range(T):
        m = load_GT[0, t]
        for g in range(1, G):
            if load_GT[g, t] > m:
                m = load_GT[g, t]
        peak_T[t] = m
    for t in range(T):
        if keep >= T:
            kept_T[t] = True
            continue
        rank = 0
        for u in range(T):
            if peak_T[u] < peak_T[t] or (peak_T[u] == peak_T[t] and u < t):
                rank += 1
        kept_T[t] = rank < keep


@njit(cache=True, nogil=True)
def _best_swap(src_K, threshold, peak, beta, phy_P, bound_P, holds, gpus_per_unit, e_GT, sum_G, root_GT, v_PT,
               y_PT, pairs, scratch):
    """One round of `_layer`'s search: the best swap (a, b) of a slot on a GPU of src_K with a
    slot elsewhere whose gain beats `threshold` ((-1, -1): none), the exponentials e_GT taken
    at `peak`. `pairs` holds the best swap of GPU pairs scored in an earlier round (`_layer`);
    the pairs this round scores in full are recorded there."""
    known_GG, pair_gain_GG, pair_a_GG, pair_b_GG, pair_peak_GG, pair_base_GG = pairs
    u_RT, x_RT, ok_R, c1_RS, c2_RS, cap_G, pg_G, pa_G, pb_G, whole_G = scratch
    G, T = e_GT.shape
    P = phy_P.shape[0]
    S = P // G
    K = src_K.shape[0]
    best = threshold
    ba = -1
    bb = -1
    best_flat = 0
    for k in range(K):
        A = src_K[k]
        for B in range(G):  # pairs scored at this peak in an earlier round: their best swap as it was
            if B != A and known_GG[A, B] and pair_peak_GG[A, B] == peak and pair_a_GG[A, B] >= 0:
                gain = pair_gain_GG[A, B]
                flat = (k * S + pair_a_GG[A, B] - A * S) * P + pair_b_GG[A, B]
                if gain > best or (gain == best and ba >= 0 and flat < best_flat):
                    best = gain
                    ba = pair_a_GG[A, B]
                    bb = pair_b_GG[A, B]
                    best_flat = flat
        # No swap between GPUs A and B gains more than sum_t (sqrt(e_At) - sqrt(e_Bt))^2 (by
        # x v + u y >= 2 sqrt(x v u y) per window): GPUs are tried by that bound, highest
        # first, and the rest skipped once it falls below the best gain (with a margin far
        # above rounding, so the swap chosen is the one an exhaustive search chooses). A pair
        # scored at another peak m0 has every gain scaled by exp(beta (m0 - peak)) since (all
        # its exponentials are), so its best gain then, scaled, bounds its gains now (the
        # margin covers the rounding of either round's sums).
        for g in range(G):
            r = 0.0
            for t in range(T):
                d = root_GT[A, t] - root_GT[g, t]
                r += d * d
            cap_G[g] = r + 1e-12 * (sum_G[A] + sum_G[g])
            pg_G[g] = -np.inf
            pa_G[g] = -1
            pb_G[g] = -1
            whole_G[g] = not (known_GG[A, g] and pair_peak_GG[A, g] == peak)
            if known_GG[A, g] and pair_peak_GG[A, g] != peak:
                if pair_a_GG[A, g] < 0:
                    cap_G[g] = -np.inf  # no swap of the pair is allowed: none will be while neither changes
                else:
                    was = pair_gain_GG[A, g]
                    scaled = np.exp(beta * (pair_peak_GG[A, g] - peak)) * (1.0 + 1e-12) * (
                        was + 1e-10 * (pair_base_GG[A, g] + abs(was)))
                    cap_G[g] = min(cap_G[g], scaled)
        cap_G[A] = -1.0
        whole_G[A] = False
        by_cap = np.argsort(-cap_G)
        unit_a = A // gpus_per_unit
        # A's slots in tiles of _TILE, each tile scored against all of B's slots at once.
        for sa0 in range(0, S, _TILE):
            n = min(_TILE, S - sa0)
            for r in range(n):
                a = A * S + sa0 + r
                for t in range(T):
                    u_RT[r, t] = v_PT[a, t]
                    x_RT[r, t] = e_GT[A, t] / u_RT[r, t]
            for i in range(G - 1):
                B = by_cap[i]
                if known_GG[A, B] and pair_peak_GG[A, B] == peak:
                    continue
                if cap_G[B] < best:
                    for j in range(i, G - 1):
                        whole_G[by_cap[j]] = False  # not all of its tiles scored: not kept
                    break
                some = False
                for r in range(n):
                    a = A * S + sa0 + r
                    ok_R[r] = not (holds[B, phy_P[a]] or (bound_P[a] and B // gpus_per_unit != unit_a))
                    some = some or ok_R[r]
                if not some:
                    continue
                o = B * S
                _swap_costs(x_RT, u_RT, v_PT, y_PT, o, S, n, c1_RS, c2_RS)
                base = sum_G[A] + sum_G[B]
                # The pair's best swap, the first in numpy's flat order (q, b) among ties.
                g_best = pg_G[B]
                g_a = -1
                g_b = -1
                for r in range(n):
                    if not ok_R[r]:
                        continue
                    a = A * S + sa0 + r
                    for s in range(S):
                        gain = base - c1_RS[r, s] - c2_RS[r, s]
                        if gain > g_best:
                            b = o + s
                            if holds[A, phy_P[b]]:
                                continue
                            if bound_P[b] and B // gpus_per_unit != unit_a:
                                continue
                            g_best = gain
                            g_a = a
                            g_b = b
                if g_a < 0:
                    continue
                pg_G[B] = g_best
                pa_G[B] = g_a
                pb_G[B] = g_b
                flat = (k * S + g_a - A * S) * P + g_b
                if g_best > best or (g_best == best and ba >= 0 and flat < best_flat):
                    best = g_best
                    ba = g_a
                    bb = g_b
                    best_flat = flat
        for B in range(G):
            if whole_G[B]:
                known_GG[A, B] = True
                pair_gain_GG[A, B] = pg_G[B]
                pair_a_GG[A, B] = pa_G[B]
                pair_b_GG[A, B] = pb_G[B]
                pair_peak_GG[A, B] = peak
                pair_base_GG[A, B] = sum_G[A] + sum_G[B]
    return ba, bb


@njit(cache=True, nogil=True)
def _layer(phy_P, w_PT, bound_P, G, beta, max_rounds, keep, top_gpus, gpus_per_unit, E):
    """The swap search on one layer, in place on phy_P, w_PT and bound_P; returns the swaps."""
    P, T = w_PT.shape
    S = P // G
    K = min(top_gpus, G)
    holds = np.zeros((G, E), dtype=np.bool_)
    for p in range(P):
        holds[p // S, phy_P[p]] = True
    v_PT = np.empty((P, T))
    for p in range(P):
        for t in range(T):
            v_PT[p, t] = np.exp(min(beta * w_PT[p, t], 600.0))
    load_GT = np.empty((G, T))
    e_GT = np.empty((G, T))
    w_flat = w_PT.reshape(P * T)  # views: slot loads and exponentials as flat rows for `_pairwise`
    e_flat = e_GT.reshape(G * T)
    sum_G = np.empty(G)
    y_PT = np.empty((P, T))
    root_GT = np.empty((G, T))
    kept_T = np.empty(T, dtype=np.bool_)
    peak_T = np.empty(T)
    gpu_peak_G = np.empty(G)
    src_K = np.empty(K, dtype=np.int64)
    taken_G = np.zeros(G, dtype=np.bool_)
    # A swap changes the loads of two GPUs only: each round recomputes the rows of GPUs whose
    # loads (or, for e, y and root, the peak or the kept windows) changed, by the same
    # arithmetic as a full pass, so the values are the same to the bit.
    fresh_G = np.ones(G, dtype=np.bool_)   # loads of GPU g changed since last computed
    last_kept_T = np.zeros(T, dtype=np.bool_)
    last_peak = np.nan
    # Best swap of each GPU pair (source A, target B) from the round that scored it, with the
    # peak and the two GPUs' sums of exponentials then. It holds while neither GPU changes and
    # the kept windows stay: at the same peak the pair's gains are the same to the bit, at
    # another one they are scaled (`_best_swap` bounds them with it), so a round rescores the
    # pairs of the two GPUs last swapped and those whose bound can still win.
    known_GG = np.zeros((G, G), dtype=np.bool_)
    pairs = (known_GG, np.empty((G, G)), np.empty((G, G), dtype=np.int64), np.empty((G, G), dtype=np.int64),
             np.empty((G, G)), np.empty((G, G)))
    # `_best_swap`'s scratch: a tile of source slots, their swaps' sums, and per-GPU bounds and pair bests.
    scratch = (np.empty((_TILE, T)), np.empty((_TILE, T)), np.empty(_TILE, dtype=np.bool_), np.empty((_TILE, S)),
               np.empty((_TILE, S)), np.empty(G), np.empty(G), np.empty(G, dtype=np.int64),
               np.empty(G, dtype=np.int64), np.empty(G, dtype=np.bool_))
    swaps = 0
    for _ in range(max_rounds):
        # GPU loads per window, summed over the GPU's slots as numpy sums them: slot by slot
        # across windows, or pairwise when there is one window (the slots are contiguous then).
        for g in range(G):
            if not fresh_G[g]:
                continue
            if T == 1:
                load_GT[g, 0] = _pairwise(w_flat, g * S, S, 1)
                continue
            for t in range(T):
                load_GT[g, t] = w_PT[g * S, t]
            for s in range(1, S):
                for t in range(T):
                    load_GT[g, t] += w_PT[g * S + s, t]
        _kept(load_GT, keep, kept_T, peak_T)
        peak = -np.inf
        for g in range(G):
            gp = -np.inf
            for t in range(T):
                if kept_T[t] and load_GT[g, t] > gp:
                    gp = load_GT[g, t]
            gpu_peak_G[g] = gp
            if gp > peak:
                peak = gp
        # The top_gpus GPUs by worst kept-window load, descending (ties: lower index first).
        for g in range(G):
            taken_G[g] = False
        for k in range(K):
            bg = -1
            for g in range(G):
                if not taken_G[g] and (bg < 0 or gpu_peak_G[g] > gpu_peak_G[bg]):
                    bg = g
            src_K[k] = bg
            taken_G[bg] = True
        same_kept = True
        for t in range(T):
            same_kept = same_kept and kept_T[t] == last_kept_T[t]
            last_kept_T[t] = kept_T[t]
        same = same_kept and peak == last_peak
        last_peak = peak
        for g in range(G):
            if not same_kept:
                known_GG[g, :] = False
            elif fresh_G[g]:
                known_GG[g, :] = False
                known_GG[:, g] = False
        for g in range(G):
            if same and not fresh_G[g]:
                continue
            for t in range(T):
                e_GT[g, t] = np.exp(beta * (load_GT[g, t] - peak)) if kept_T[t] else 0.0
            sum_G[g] = _pairwise(e_flat, g * T, T, 1)
            for p in range(g * S, (g + 1) * S):
                for t in range(T):
                    y_PT[p, t] = e_GT[g, t] / v_PT[p, t]
            for t in range(T):
                root_GT[g, t] = np.sqrt(e_GT[g, t])
            fresh_G[g] = False
        z = _pairwise(e_flat, 0, G * T, 1)
        # A swap helps only if its gain beats 1e-9 z (else the search stops): start there.
        ba, bb = _best_swap(src_K, 1e-9 * z, peak, beta, phy_P, bound_P, holds, gpus_per_unit, e_GT, sum_G, root_GT,
                            v_PT, y_PT, pairs, scratch)
        if ba < 0:
            break
        ea = phy_P[ba]
        eb = phy_P[bb]
        A = ba // S
        B = bb // S
        holds[A, ea] = False
        holds[B, eb] = False
        holds[A, eb] = True
        holds[B, ea] = True
        phy_P[ba] = eb
        phy_P[bb] = ea
        for t in range(T):
            x = w_PT[ba, t]
            w_PT[ba, t] = w_PT[bb, t]
            w_PT[bb, t] = x
            x = v_PT[ba, t]
            v_PT[ba, t] = v_PT[bb, t]
            v_PT[bb, t] = x
        x = bound_P[ba]
        bound_P[ba] = bound_P[bb]
        bound_P[bb] = x
        fresh_G[A] = True
        fresh_G[B] = True
        swaps += 1
    return swaps


@njit(cache=True, nogil=True)
def smooth_max_swaps(phy_LP, w_LPT, bound_LP, G, beta, max_rounds, keep, top_gpus, gpus_per_unit):
    """`planners.robust.smooth_max_swaps` on every layer, in place on phy_LP (int64 [L, P]),
    w_LPT (float64 [L, P, T]) and bound_LP (bool [L, P]); keep: windows the objective covers
    (the keep lowest peaks; >= T: all). Returns the swaps made."""
    L = phy_LP.shape[0]
    E = 0
    for l in range(L):
        for p in range(phy_LP.shape[1]):
            if phy_LP[l, p] + 1 > E:
                E = phy_LP[l, p] + 1
    swaps = 0
    for l in range(L):
        swaps += _layer(phy_LP[l], w_LPT[l], bound_LP[l], G, beta, max_rounds, keep, top_gpus, gpus_per_unit, E)
    return swaps


def warm_up() -> None:
    """Run the kernel once on tiny inputs of the argument types the real calls use (loads it
    from numba's cache, or compiles it into the cache)."""
    phy = np.array([[0, 1, 2, 0]], dtype=np.int64)
    w = np.array([[[3.0], [1.0], [1.0], [2.0]]])
    smooth_max_swaps(phy, w, np.zeros((1, 4), dtype=np.bool_), 2, 50.0, 2, 1, 2, 2)
    rep = np.array([[0, 1, 2, 0]], dtype=np.int64)
    order = np.array([[[1, 0], [0, 1]]], dtype=np.int64)
    pack_vector(np.ones((1, 3, 2)), rep, order, 2, 2, 1e9)
    pack_vector(np.ones((1, 3, 1)), rep, order, 2, 2, 1e9)
