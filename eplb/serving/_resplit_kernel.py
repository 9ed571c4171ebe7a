"""Compiled kernels of the re-split repair (eplb/serving/resplit_repair.py is their Python side).

Legend: M = scenarios (windows), L = MoE layers, E = logical experts, G = GPUs, S = slots per
GPU, P = G x S physical slots, N = 2**G subsets of GPUs.

Under per-batch re-split an expert's tokens may go to any GPU holding one of its replicas, in
any shares, so the busiest GPU of a window is the least t for which that flow exists. By Hall's
theorem (max-flow / min-cut) that is max over non-empty GPU sets X of (the load of the experts
whose every replica lies in X) / |X|. With each expert's GPU set a bit mask m_e, the window's
f[X] = sum of load_e over m_e within X, so a layer is scored over all N subsets exactly; at
eight GPUs N = 256. (The rule `eplb.dispatch.Resplitter` converges to the same optimum.)
"""

from __future__ import annotations

import numpy as np

from eplb.core.jit import kernel


@kernel
def _inverse_sizes(G):
    """1 / |X| for every non-empty subset X of G GPUs, [N] (0 for the empty set)."""
    n = 1 << G
    inv = np.zeros(n)
    for s in range(1, n):
        c, x = 0, s
        while x:
            c += x & 1
            x >>= 1
        inv[s] = 1.0 / c
    return inv


@kernel
def _add(f_MN, load_M, m, sign):
    """f[:, X] += sign x load for every X that contains mask m (its supersets, enumerated)."""
    full = f_MN.shape[1] - 1
    s = m
    while True:
        for w in range(f_MN.shape[0]):
            f_MN[w, s] += sign * load_M[w]
        if s == full:
            break
        s = (s + 1) | m


@kernel(inline=True)
def _add_scenario(acc, seen, worst, t, w, wsum):
    """Fold one scenario's busiest / mean GPU t, of weight w, into the running cost's weighted
    sum, weight seen and worst; also returns a lower bound on the whole cost: the scenarios not
    seen yet add at least 1 each to the mean (no GPU set beats the mean)."""
    acc += w * t
    seen += w
    if t > worst:
        worst = t
    return acc, seen, worst, 0.5 * (acc + (wsum - seen)) / wsum + 0.5 * worst


@kernel
def _cost(f_MN, inv_N, mean_M, w_M, wsum, bound):
    """Half the weighted mean, half the worst scenario of busiest / mean GPU; stops early (returns
    a value >= bound) once the scenarios seen already cost at least `bound`."""
    M, n = f_MN.shape
    acc, worst, seen = 0.0, 0.0, 0.0
    for w in range(M):
        b = 0.0
        for s in range(1, n):
            v = f_MN[w, s] * inv_N[s]
            if v > b:
                b = v
        acc, seen, worst, low = _add_scenario(acc, seen, worst, b / mean_M[w] if mean_M[w] > 0 else 1.0, w_M[w],
                                              wsum)
        if low >= bound:
            return low
    return 0.5 * acc / wsum + 0.5 * worst


@kernel
def _masks(cnt_EG, e):
    m = 0
    for g in range(cnt_EG.shape[1]):
        if cnt_EG[e, g] > 0:
            m |= 1 << g
    return m


@kernel
def _try(f_MN, loadT_EM, m_E, cnt_EG, e, g, h, e2, g2, h2):
    """Move one replica of e from GPU g to h and one of e2 (e2 >= 0) from g2 to h2 in the counts;
    update f for the masks that change. Returns (new mask of e, new mask of e2)."""
    cnt_EG[e, g] -= 1
    cnt_EG[e, h] += 1
    if e2 >= 0:
        cnt_EG[e2, g2] -= 1
        cnt_EG[e2, h2] += 1
    me = _masks(cnt_EG, e)
    if me != m_E[e]:
        _add(f_MN, loadT_EM[e], m_E[e], -1.0)
        _add(f_MN, loadT_EM[e], me, 1.0)
    me2 = -1
    if e2 >= 0:
        me2 = _masks(cnt_EG, e2)
        if me2 != m_E[e2]:
            _add(f_MN, loadT_EM[e2], m_E[e2], -1.0)
            _add(f_MN, loadT_EM[e2], me2, 1.0)
    return me, me2


@kernel
def _undo(f_MN, loadT_EM, m_E, cnt_EG, e, g, h, e2, g2, h2, me, me2):
    if me != m_E[e]:
        _add(f_MN, loadT_EM[e], me, -1.0)
        _add(f_MN, loadT_EM[e], m_E[e], 1.0)
    cnt_EG[e, g] += 1
    cnt_EG[e, h] -= 1
    if e2 >= 0:
        if me2 != m_E[e2]:
            _add(f_MN, loadT_EM[e2], me2, -1.0)
            _add(f_MN, loadT_EM[e2], m_E[e2], 1.0)
        cnt_EG[e2, g2] += 1
        cnt_EG[e2, h2] -= 1


@kernel
def _pair_tables(f_MN, G, out_GGM, top_GGKM):
    """For every ordered GPU pair (g, h): the best f[X] / |X| over the sets X holding both or
    neither (out_GGM), and the largest f[X] over the sets of each size k holding g but not h
    (top_GGKM[g, h, k]). A swap of two experts with one replica each, g's to h and h's to g,
    changes f only on the sets holding one of the two GPUs, by the same amount for all of them,
    so these tables score it without touching f (`_swap_cost`)."""
    M, n = f_MN.shape
    out_GGM[:] = 0.0
    top_GGKM[:] = -np.inf
    for s in range(1, n):
        k = 0
        x = s
        while x:
            k += x & 1
            x >>= 1
        for g in range(G):
            in_g = (s >> g) & 1
            for h in range(G):
                if h == g:
                    continue
                in_h = (s >> h) & 1
                if in_g == in_h:
                    for w in range(M):
                        v = f_MN[w, s] / k
                        if v > out_GGM[g, h, w]:
                            out_GGM[g, h, w] = v
                elif in_g:
                    for w in range(M):
                        if f_MN[w, s] > top_GGKM[g, h, k, w]:
                            top_GGKM[g, h, k, w] = f_MN[w, s]


@kernel
def _swap_cost(out_GGM, top_GGKM, loadT_EM, e, g, e2, h, mean_M, w_M, wsum, bound):
    """`_cost` after single-replica expert e moves from GPU g to h and e2 from h to g (tables of
    `_pair_tables`); stops early as `_cost` does."""
    M = mean_M.shape[0]
    G = out_GGM.shape[0]
    acc, worst, seen = 0.0, 0.0, 0.0
    for w in range(M):
        d = loadT_EM[e2, w] - loadT_EM[e, w]        # sets with g lose e and gain e2; with h, the reverse
        b = out_GGM[g, h, w]
        for k in range(1, G):
            v = (top_GGKM[g, h, k, w] + d) / k
            if v > b:
                b = v
            v = (top_GGKM[h, g, k, w] - d) / k
            if v > b:
                b = v
        acc, seen, worst, low = _add_scenario(acc, seen, worst, b / mean_M[w] if mean_M[w] > 0 else 1.0, w_M[w],
                                              wsum)
        if low >= bound:
            return low
    return 0.5 * acc / wsum + 0.5 * worst


@kernel
def _layer(phy_P, load_ME, w_M, G, rounds, price):
    """Local search on one layer: swaps of two slots' experts between GPUs (two moves) and a
    spare replica rewritten to another expert (one move), each kept when it lowers the cost by
    more than `price` per move; at most `rounds` passes over the slots. Returns (cost before,
    cost after); phy_P is changed in place."""
    P = phy_P.shape[0]
    M, E = load_ME.shape
    S = P // G
    n = 1 << G
    inv_N = _inverse_sizes(G)
    mean_M = load_ME.sum(axis=1) / G
    wsum = w_M.sum()
    loadT_EM = np.ascontiguousarray(load_ME.T)
    cnt_EG = np.zeros((E, G), np.int64)
    r_E = np.zeros(E, np.int64)
    for p in range(P):
        cnt_EG[phy_P[p], p // S] += 1
        r_E[phy_P[p]] += 1
    m_E = np.zeros(E, np.int64)
    f_MN = np.zeros((M, n))
    for e in range(E):
        m_E[e] = _masks(cnt_EG, e)
        _add(f_MN, loadT_EM[e], m_E[e], 1.0)
    before = _cost(f_MN, inv_N, mean_M, w_M, wsum, np.inf)
    best = before
    out_GGM = np.zeros((G, G, M))
    top_GGKM = np.full((G, G, G, M), -np.inf)
    stale = True                                    # the pair tables follow f after each change
    for _ in range(rounds):
        if best <= 1.0 + 1e-12:
            break                                   # every scenario already perfectly balanced
        improved = False
        for p in range(P):
            g = p // S
            for q in range(p + 1, P):
                e, e2, h = phy_P[p], phy_P[q], q // S
                if h == g or e2 == e:
                    continue
                bound = best - 2.0 * price
                if r_E[e] == 1 and r_E[e2] == 1:
                    if stale:
                        _pair_tables(f_MN, G, out_GGM, top_GGKM)
                        stale = False
                    c = _swap_cost(out_GGM, top_GGKM, loadT_EM, e, g, e2, h, mean_M, w_M, wsum, bound)
                    if c < bound:
                        me, me2 = _try(f_MN, loadT_EM, m_E, cnt_EG, e, g, h, e2, h, g)
                        best, improved, stale = c, True, True
                        phy_P[p], phy_P[q] = e2, e
                        m_E[e], m_E[e2] = me, me2
                    continue
                me, me2 = _try(f_MN, loadT_EM, m_E, cnt_EG, e, g, h, e2, h, g)
                if me == m_E[e] and me2 == m_E[e2]:
                    _undo(f_MN, loadT_EM, m_E, cnt_EG, e, g, h, e2, h, g, me, me2)
                    continue
                c = _cost(f_MN, inv_N, mean_M, w_M, wsum, bound)
                if c < bound:
                    best, improved, stale = c, True, True
                    phy_P[p], phy_P[q] = e2, e
                    m_E[e], m_E[e2] = me, me2
                else:
                    _undo(f_MN, loadT_EM, m_E, cnt_EG, e, g, h, e2, h, g, me, me2)
            e = phy_P[p]
            if r_E[e] < 2:
                continue
            # Slot p's replica is a spare: write another expert over it (counts: e loses one on g).
            for e2 in range(E):
                if e2 == e:
                    continue
                cnt_EG[e, g] -= 1
                cnt_EG[e2, g] += 1
                me = _masks(cnt_EG, e)
                me2 = _masks(cnt_EG, e2)
                if me != m_E[e]:
                    _add(f_MN, loadT_EM[e], m_E[e], -1.0)
                    _add(f_MN, loadT_EM[e], me, 1.0)
                if me2 != m_E[e2]:
                    _add(f_MN, loadT_EM[e2], m_E[e2], -1.0)
                    _add(f_MN, loadT_EM[e2], me2, 1.0)
                bound = best - price
                c = _cost(f_MN, inv_N, mean_M, w_M, wsum, bound) if (me != m_E[e] or me2 != m_E[e2]) else best
                if c < bound:
                    best, improved, stale = c, True, True
                    phy_P[p] = e2
                    m_E[e], m_E[e2] = me, me2
                    r_E[e] -= 1
                    r_E[e2] += 1
                    break
                if me != m_E[e]:
                    _add(f_MN, loadT_EM[e], me, -1.0)
                    _add(f_MN, loadT_EM[e], m_E[e], 1.0)
                if me2 != m_E[e2]:
                    _add(f_MN, loadT_EM[e2], me2, -1.0)
                    _add(f_MN, loadT_EM[e2], m_E[e2], 1.0)
                cnt_EG[e, g] += 1
                cnt_EG[e2, g] -= 1
        if not improved:
            break
    return before, best


@kernel
def resplit_search(phy_LP, load_MLE, w_M, G, rounds, price):
    """The local search of every layer (see _layer); returns (new map [L, P], cost [L, 2]: before,
    after)."""
    L = phy_LP.shape[0]
    out = phy_LP.copy()
    cost_L2 = np.empty((L, 2))
    for l in range(L):
        row = out[l].copy()
        b, a = _layer(row, np.ascontiguousarray(load_MLE[:, l, :]), w_M, G, rounds, price)
        out[l] = row
        cost_L2[l, 0], cost_L2[l, 1] = b, a
    return out, cost_L2


@kernel
def resplit_busiest(phy_LP, load_MLE, G):
    """Busiest / mean GPU under the best re-split of each scenario and layer, [M, L]."""
    L, P = phy_LP.shape
    M, _, E = load_MLE.shape
    S = P // G
    n = 1 << G
    inv_N = _inverse_sizes(G)
    out = np.ones((M, L))
    for l in range(L):
        m_E = np.zeros(E, np.int64)
        for p in range(P):
            m_E[phy_LP[l, p]] |= 1 << (p // S)
        for w in range(M):
            f_N = np.zeros(n)
            tot = 0.0
            for e in range(E):
                x = load_MLE[w, l, e]
                tot += x
                m = m_E[e]
                s = m
                while True:
                    f_N[s] += x
                    if s == n - 1:
                        break
                    s = (s + 1) | m
            if tot > 0:
                b = 0.0
                for s in range(1, n):
                    v = f_N[s] * inv_N[s]
                    if v > b:
                        b = v
                out[w, l] = b / (tot / G)
    return out
