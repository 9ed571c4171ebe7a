"""The adaptive policy's repair (eplb/serving/_policy_kernel.py `repair`) in whole-array numpy, all layers at once.

Legend: R = rows (layers, or layers x blends while filling), M = windows, E = logical experts,
G = GPUs, S = slots per GPU, P = G x S slots, B = demand blends, N = candidate swaps of a row
(2 source GPUs x S slots x C partner slots).

The kernel's steps, each a numpy step over every row still working (no loop over rows, slots or
candidates): target counts (the heap's order as one partition), the fill one replica per row and
step, and the swaps one per row and round, every candidate of every row priced at once with the
kernel's factored gain summed window by window in its order. Choices closer than the kernel's
_TIE are resolved as it resolves them, by first-in-order record setting (`_records`). Loads are
summed afresh where the kernel keeps them incrementally, so a choice can differ where two are
within rounding; benchmarks/bench_kernels.py reports whether the maps agree.
"""

from __future__ import annotations

import numpy as np

_TIE = 1e-12
_EXP_CLIP = 600.0
_SOURCES = 2
_FLOOR = 1e-9


def _seq_sum(a, axis):
    """Sum along axis in index order (the kernels' order, not numpy's pairwise one)."""
    return np.cumsum(a, axis=axis).take(-1, axis=axis)


def _records(v_RN, ok_RN, larger: bool):
    """Per row, the index the kernel's scan ends on: the first allowed entry, replaced by each later
    one beyond the current by more than _TIE of it (larger: v > best + TIE |best|; else smaller:
    v < best - TIE best); -1 where none is allowed."""
    R, N = v_RN.shape
    rows = np.arange(R)
    cur = np.where(ok_RN.any(axis=1), ok_RN.argmax(axis=1), -1)
    pos = np.arange(N)[None, :]
    while True:
        has = cur >= 0
        best = v_RN[rows, np.maximum(cur, 0)]
        if larger:
            beat = v_RN > (best + _TIE * np.abs(best))[:, None]
        else:
            beat = v_RN < (best - _TIE * best)[:, None]
        beat &= ok_RN & (pos > cur[:, None]) & has[:, None]
        nxt = beat.any(axis=1)
        if not nxt.any():
            return cur
        cur = np.where(nxt, beat.argmax(axis=1), cur)


def _loads(phy_RP, cnt_RE, share_REM, G):
    """GPU loads of every window under an even split, [R, G, M] (slots summed in order)."""
    R, P = phy_RP.shape
    rows = np.arange(R)[:, None]
    w_RPM = share_REM[rows, phy_RP] / cnt_RE[rows, phy_RP][..., None]
    return _seq_sum(w_RPM.reshape(R, G, P // G, -1), axis=2)


def _cost(load_RGM, w_M, worst_weight):
    """(cost, worst window's busiest) per row, as the kernel's `_cost`."""
    top_RM = load_RGM.max(axis=1)
    total, wsum = _seq_sum(w_M * top_RM, axis=1), _seq_sum(w_M, axis=0)
    worst = top_RM.max(axis=1)
    return (1.0 - worst_weight) * total / wsum + worst_weight * worst, worst


def _targets(share_REM, w_M, blend, P, G):
    """Replica counts [R, E] of the blended demand, as the kernel's `_demand` and `_targets`."""
    R, E, M = share_REM.shape
    mean = _seq_sum(w_M * share_REM, axis=2) / _seq_sum(w_M, axis=0)
    mx = np.maximum(share_REM.max(axis=2), 0.0)
    key = mean + blend * (mx - mean)
    bonus = 1e-9 * np.maximum(np.maximum(key.max(axis=1), 0.0), 1.0)
    key = key + bonus[:, None] * (E - np.arange(E)) / E
    count = np.ones((R, E), dtype=np.int64)
    n = P - E
    if n <= 0 or G < 2:
        return key, count
    v_RX = (key[:, :, None] / np.arange(1, G)).reshape(R, -1)    # expert-major: ties by id, then count
    kth = -np.partition(-v_RX, n - 1, axis=1)[:, n - 1:n]
    above, tie = v_RX > kth, v_RX == kth
    take = above | (tie & (np.cumsum(tie, axis=1) <= n - above.sum(axis=1, keepdims=True)))
    return key, count + take.reshape(R, E, G - 1).sum(axis=2)


def _holds(phy_RP, E, G):
    R, P = phy_RP.shape
    hold = np.zeros((R, E, G), dtype=np.int64)
    np.add.at(hold, (np.arange(R)[:, None], phy_RP, np.arange(P)[None, :] // (P // G)), 1)
    return hold


def _fill(phy_RP, target_RE, share_REM, was_REG, G, cap_total, cap_G):
    """Step 2 in place on phy_RP: experts below target, lowest id first, each gets a replica in
    the first donor slot (an expert above target with >= 2 replicas) of the GPU without it whose
    worst window is lightest. Returns (moves per row, moves onto each GPU [R, G])."""
    R, P = phy_RP.shape
    E, S = target_RE.shape[1], P // G
    rows_all = np.arange(R)
    cnt = np.zeros((R, E), dtype=np.int64)
    np.add.at(cnt, (rows_all[:, None], phy_RP), 1)
    hold = _holds(phy_RP, E, G)
    moved = np.zeros(R, dtype=np.int64)
    in_RG = np.zeros((R, G), dtype=np.int64)
    ptr = np.zeros(R, dtype=np.int64)
    gpu_P = np.arange(P) // S
    capped = cap_total < np.inf or np.min(cap_G) < np.inf
    active = rows_all
    while active.size:
        # Each row's next expert below target, from where it stands (an expert no slot could
        # serve was passed over for good).
        short = (cnt[active] < target_RE[active]) & (np.arange(E)[None, :] >= ptr[active, None])
        active = active[short.any(axis=1)]
        if not active.size:
            break
        e = (short[short.any(axis=1)]).argmax(axis=1)
        ptr[active] = e
        r2 = active[:, None]
        x_RP = phy_RP[active]
        donor = (cnt[r2, x_RP] > target_RE[r2, x_RP]) & (cnt[r2, x_RP] > 1) & (hold[r2, e[:, None], gpu_P] == 0)
        if capped:
            d = (~was_REG[r2, e[:, None], gpu_P]).astype(np.int64) \
                - ((hold[r2, x_RP, gpu_P] == 1) & ~was_REG[r2, x_RP, gpu_P])
            donor &= (moved[active, None] + d <= cap_total) & (in_RG[r2, gpu_P] + d <= cap_G[gpu_P])
        donor_RGS = donor.reshape(-1, G, S)
        has_RG = donor_RGS.any(axis=2)
        peak_RG = _loads(phy_RP[active], cnt[active], share_REM[active], G).max(axis=2)
        g = _records(peak_RG, has_RG, larger=False)
        stuck = g < 0
        ptr[active[stuck]] += 1
        go = ~stuck
        a, g = active[go], g[go]
        if not a.size:
            continue
        p = g * S + donor_RGS[go][np.arange(a.size), g].argmax(axis=1)
        x, ee = phy_RP[a, p], e[go]
        d = (~was_REG[a, ee, g]).astype(np.int64) - ((hold[a, x, g] == 1) & ~was_REG[a, x, g])
        in_RG[a, g] += d
        moved[a] += d
        phy_RP[a, p] = ee
        cnt[a, x] -= 1
        cnt[a, ee] += 1
        hold[a, x, g] -= 1
        hold[a, ee, g] += 1
    return moved, in_RG


def _terms(load_RGM, w_M, top_R, beta):
    e_RGM = w_M * np.exp(beta * (load_RGM - top_R[:, None, None]))
    return e_RGM, _seq_sum(e_RGM, axis=2), load_RGM.max(axis=2)


def _swaps(phy_RP, share_REM, w_M, was_REG, rounds_R, G, beta, partners, moved, in_RG, cap_total, cap_G):
    """Step 3 in place on phy_RP: up to rounds_R swaps per row, each the one that lowers the
    smooth maximum of the (GPU, window) loads most, while it drops by the floor."""
    R, P = phy_RP.shape
    E, M = share_REM.shape[1:]
    S = P // G
    rows_all = np.arange(R)
    cnt = np.zeros((R, E), dtype=np.int64)
    np.add.at(cnt, (rows_all[:, None], phy_RP), 1)
    hold = _holds(phy_RP, E, G)
    w_REM = share_REM / cnt[..., None]
    x_REM = np.exp(np.minimum(beta * w_REM, _EXP_CLIP))
    ix_REM = 1.0 / x_REM
    load = _loads(phy_RP, cnt, share_REM, G)
    top = load.max(axis=(1, 2))
    e_RGM, esum_RG, peak_RG = _terms(load, w_M, top, beta)
    n_src, C = min(_SOURCES, G), min(partners, G)
    capped = cap_total < np.inf or np.min(cap_G) < np.inf
    gidx = np.broadcast_to(np.arange(G), (R, G))
    active = rows_all[rounds_R > 0]
    for rnd in range(int(rounds_R.max(initial=0))):
        active = active[rounds_R[active] > rnd]
        if not active.size:
            break
        n = active.size
        r1, r2 = np.arange(n), active[:, None]
        pk = peak_RG[active]
        heavy = np.lexsort((gidx[:n], -pk), axis=1)                 # heaviest first, lower GPU on ties
        src = heavy[:, :n_src]
        part = gidx[:n] if partners >= G else np.lexsort((-gidx[:n], pk), axis=1)[:, :C]
        slot_S = np.arange(S)
        a_AS = (src[:, :, None] * S + slot_S).reshape(n, -1)        # [n, 2S] source slots
        b_AK = (part[:, :, None] * S + slot_S).reshape(n, -1)       # [n, C S] candidate slots
        ea, eb = phy_RP[r2, a_AS], phy_RP[r2, b_AK]
        A_, B_ = a_AS // S, b_AK // S
        # The factored gain, window by window in the kernel's order.
        gain = esum_RG[r2, A_][:, :, None] + esum_RG[r2, B_][:, None, :]
        for m in range(M):
            am = e_RGM[r2, A_, m] * ix_REM[r2, ea, m]
            bm = e_RGM[r2, B_, m] * ix_REM[r2, eb, m]
            gain -= am[:, :, None] * x_REM[r2, eb, m][:, None, :] + x_REM[r2, ea, m][:, :, None] * bm[:, None, :]
        ok = (B_[:, None, :] != A_[:, :, None]) & (hold[r2[:, :, None], eb[:, None, :], A_[:, :, None]] == 0)
        ok &= (eb[:, None, :] != ea[:, :, None]) & (hold[r2[:, :, None], ea[:, :, None], B_[:, None, :]] == 0)
        if capped:
            r3, ea3, eb3, A3, B3 = r2[:, :, None], ea[:, :, None], eb[:, None, :], A_[:, :, None], B_[:, None, :]
            dA = _moves_onto(hold, was_REG, r3, eb3, ea3, A3)
            dB = _moves_onto(hold, was_REG, r3, ea3, eb3, B3)
            ok &= (moved[active, None, None] + dA + dB <= cap_total) & (in_RG[r2[:, :, None], A3] + dA <= cap_G[A3]) \
                & (in_RG[r2[:, :, None], B3] + dB <= cap_G[B3])
        pick = _records(gain.reshape(n, -1), ok.reshape(n, -1), larger=True)
        z = _seq_sum(esum_RG[active], axis=1)
        best = gain.reshape(n, -1)[r1, np.maximum(pick, 0)]
        go = (pick >= 0) & (best > _FLOOR * z)
        active, pick = active[go], pick[go]
        if not active.size:
            break
        K = b_AK.shape[1]
        a, b = a_AS[go][np.arange(active.size), pick // K], b_AK[go][np.arange(active.size), pick % K]
        _swap(active, a, b, S, phy_RP, hold, was_REG, moved, in_RG, load, w_REM, w_M, top, beta, e_RGM, esum_RG,
              peak_RG)


def _moves_onto(hold, was_REG, r, e_in, e_out, g):
    """Moves onto GPU g when e_in lands there and e_out leaves: +1 for e_in new to g (held
    neither now nor in the old map), -1 for e_out's only copy there leaving, moved there."""
    arrive = (hold[r, e_in, g] == 0) & ~was_REG[r, e_in, g]
    depart = (hold[r, e_out, g] == 1) & ~was_REG[r, e_out, g]
    return arrive.astype(np.int64) - depart


def _swap(r, a, b, S, phy_RP, hold, was_REG, moved, in_RG, load, w_REM, w_M, top, beta, e_RGM, esum_RG, peak_RG):
    A, B = a // S, b // S
    ea, eb = phy_RP[r, a], phy_RP[r, b]
    dA, dB = _moves_onto(hold, was_REG, r, eb, ea, A), _moves_onto(hold, was_REG, r, ea, eb, B)
    in_RG[r, A] += dA
    in_RG[r, B] += dB
    moved[r] += dA + dB
    phy_RP[r, a], phy_RP[r, b] = eb, ea
    hold[r, ea, A] -= 1
    hold[r, eb, A] += 1
    hold[r, eb, B] -= 1
    hold[r, ea, B] += 1
    load[r, A] += w_REM[r, eb] - w_REM[r, ea]
    load[r, B] += w_REM[r, ea] - w_REM[r, eb]
    for g in (A, B):
        e_GM, esum_G, peak_G = _terms(load[r, g][:, None], w_M, top[r], beta)
        e_RGM[r, g], esum_RG[r, g], peak_RG[r, g] = e_GM[:, 0], esum_G[:, 0], peak_G[:, 0]


def _shares(windows_MLE, G):
    """Each window and layer scaled so the mean GPU load is 1 (idle ones stay 0), [L, E, M]."""
    win = np.asarray(windows_MLE, dtype=np.float64)
    tot = np.cumsum(win, axis=2)[:, :, -1:]
    return np.where(tot > 0, win * G / np.where(tot > 0, tot, 1.0), 0.0).transpose(1, 2, 0)


def window_imbalance(phy2log_LP, windows_MLE, num_gpus):
    """`eplb.serving.repair.window_imbalance` (the kernel's `window_busiest`): busiest / mean GPU, [M, L]."""
    phy = np.asarray(phy2log_LP, dtype=np.int64)
    L, E = phy.shape[0], np.shape(windows_MLE)[2]
    cnt = np.zeros((L, E), dtype=np.int64)
    np.add.at(cnt, (np.arange(L)[:, None], phy), 1)
    return np.maximum(_loads(phy, cnt, _shares(windows_MLE, int(num_gpus)), int(num_gpus)).max(axis=1), 0.0).T


def repair(phy2log_LP, windows_MLE, num_gpus, *, rounds_L, beta=50.0, blends=(0.0, 1.0), partners=8,
           swap_fills=1, worst_weight=0.5, max_moves=np.inf, max_moves_G=None, weights_M=None):
    """`eplb.serving.repair.repair` in whole-array numpy: (new_LP, cost_L2)."""
    old = np.asarray(phy2log_LP, dtype=np.int64)
    win = np.asarray(windows_MLE, dtype=np.float64)
    L, P = old.shape
    M, _, E = win.shape
    G = int(num_gpus)
    w_M = np.ones(M) if weights_M is None else np.asarray(weights_M, dtype=np.float64)
    cap_G = np.full(G, np.inf) if max_moves_G is None else np.asarray(max_moves_G, dtype=np.float64)
    rounds_L = np.asarray(rounds_L, dtype=np.int64)
    share_LEM = _shares(win, G)
    cnt_old = np.zeros((L, E), dtype=np.int64)
    np.add.at(cnt_old, (np.arange(L)[:, None], old), 1)
    old_cost, best_worst = _cost(_loads(old, cnt_old, share_LEM, G), w_M, worst_weight)
    was = _holds(old, E, G) > 0
    # Steps 1-2 for every blend: rows are (layer, blend); a blend whose demand or targets an
    # earlier one's equal is not filled (worst inf: never swapped from).
    B = len(blends)
    keys, targets = zip(*(_targets(share_LEM, w_M, float(bl), P, G) for bl in blends))
    worst_LB = np.empty((L, B))
    fills = np.repeat(old[:, None], B, axis=1)
    moved_LB, in_LBG = np.zeros((L, B), dtype=np.int64), np.zeros((L, B, G), dtype=np.int64)
    dup = np.zeros((L, B), dtype=bool)
    for k in range(1, B):
        for j in range(k):
            dup[:, k] |= (keys[j] == keys[k]).all(axis=1) | (targets[j] == targets[k]).all(axis=1)
    rows = np.flatnonzero(~dup.ravel())
    lr, br = np.divmod(rows, B)
    phy = old[lr].copy()
    m_R, in_RG = _fill(phy, np.stack(targets, axis=1)[lr, br], share_LEM[lr], was[lr], G, max_moves, cap_G)
    cnt = np.zeros((rows.size, E), dtype=np.int64)
    np.add.at(cnt, (np.arange(rows.size)[:, None], phy), 1)
    fills[lr, br], moved_LB[lr, br], in_LBG[lr, br] = phy, m_R, in_RG
    worst_LB[:] = np.inf
    worst_LB[lr, br] = _cost(_loads(phy, cnt, share_LEM[lr], G), w_M, worst_weight)[1]
    new = old.copy()
    cost_L2 = np.stack([old_cost, old_cost], axis=1)
    for _ in range(min(swap_fills, B)):
        k = np.full(L, -1)
        for j in range(B):                                          # the lightest fill left, first of near equals
            wj = worst_LB[:, j]
            wk = worst_LB[np.arange(L), np.maximum(k, 0)]
            k = np.where((wj < np.inf) & ((k < 0) | (wj < wk - _TIE * wk)), j, k)
        layers = np.flatnonzero(k >= 0)
        if not layers.size:
            break
        kk = k[layers]
        worst_LB[layers, kk] = np.inf
        phy = fills[layers, kk].copy()
        moved, in_RG = moved_LB[layers, kk].copy(), in_LBG[layers, kk].copy()
        _swaps(phy, share_LEM[layers], w_M, was[layers], rounds_L[layers], G, float(beta), int(partners), moved, in_RG,
               max_moves, cap_G)
        cnt = np.zeros((layers.size, E), dtype=np.int64)
        np.add.at(cnt, (np.arange(layers.size)[:, None], phy), 1)
        cost, worst = _cost(_loads(phy, cnt, share_LEM[layers], G), w_M, worst_weight)
        better = worst < best_worst[layers] - 1e-12
        lb = layers[better]
        best_worst[lb], new[lb], cost_L2[lb, 1] = worst[better], phy[better], cost[better]
    return new, cost_L2
