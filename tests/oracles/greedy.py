"""greedy's three steps (planners/_greedy_kernel.py, _pack_kernel.py) in whole-array numpy, over all rows at once.

Legend: R = rows (layers), E = logical experts, G = GPUs, S = slots per GPU, P = G x S slots,
X = E x (G - 1) replica candidates.

What the kernels compute, written as numpy over every row at once (no loop over rows or slots
inside a step), to time the kernels against on their serving calls (benchmarks/bench_kernels.py)
and to check them:
- `replicate`: the P - E extra replicas are the first P - E of all candidates (expert e's c-th
  extra replica, key load_e / c) by key descending, then c, then e: the heap's order;
- `pack`: longest-processing-time with a slot limit, one replica rank per step for all rows
  (a row LPT cannot finish is packed in rounds, tests/oracles/pack.py, as the kernel does);
- `refine`: one swap per step in every row still improving: every (replica on the busiest GPU,
  replica on a lighter GPU) pair is priced at once and the kernel's pick is taken: the lowest
  larger load of the pair, the first in its scan order (lighter GPUs first, the busiest GPU's
  replicas lightest first), and when settling the first GPU whose best leaves the pair at or
  below the second-busiest.
"""

from __future__ import annotations

import numpy as np

from tests.oracles import pack as plain


def replicate(load_RE, P: int, G: int) -> np.ndarray:
    """Replica counts int64 [R, E] (sum P, 1 <= count <= G), as the kernel's heap hands them out."""
    load = np.asarray(load_RE, dtype=np.float64)
    R, E = load.shape
    count = np.ones((R, E), dtype=np.int64)
    n = P - E
    if n <= 0 or G < 2:
        return count
    c = np.arange(1, G)
    key_REC = load[:, :, None] / c                               # [R, E, G - 1]
    key_RX = key_REC.transpose(0, 2, 1).reshape(R, -1)           # c-major: ties by c, then e
    kth = -np.partition(-key_RX, n - 1, axis=1)[:, n - 1:n]
    above, tie = key_RX > kth, key_RX == kth
    take = above | (tie & (np.cumsum(tie, axis=1) <= n - above.sum(axis=1, keepdims=True)))
    return count + take.reshape(R, G - 1, E).sum(axis=1)


def pack(per_RE, count_RE, G: int, S: int) -> np.ndarray:
    """phy2log int64 [R, P]: longest-processing-time with a slot limit, replicas heaviest first
    (ties by id), each to the lightest GPU (lower index on ties) with a free slot that lacks its expert."""
    per = np.asarray(per_RE, dtype=np.float64)
    count = np.asarray(count_RE, dtype=np.int64)
    R, E = per.shape
    P = G * S
    order_RE = np.argsort(-per, axis=1, kind="stable")
    # Each row's replicas in that order: expert order_RE[r, k] repeated count times.
    cnt_sorted = np.take_along_axis(count, order_RE, axis=1)
    starts = np.cumsum(cnt_sorted, axis=1) - cnt_sorted
    rank_RP = (np.arange(P)[None, :, None] >= starts[:, None, :]).sum(axis=2) - 1
    rep_RP = np.take_along_axis(order_RE, rank_RP, axis=1)
    rows = np.arange(R)
    phy = np.full((R, P), -1, dtype=np.int64)
    load_RG = np.zeros((R, G))
    fill_RG = np.zeros((R, G), dtype=np.int64)
    holds_REG = np.zeros((R, E, G), dtype=bool)
    stuck = np.zeros(R, dtype=bool)
    for i in range(P):
        e = rep_RP[:, i]
        open_RG = (fill_RG < S) & ~holds_REG[rows, e]
        stuck |= ~open_RG.any(axis=1)
        g = np.where(open_RG, load_RG, np.inf).argmin(axis=1)
        phy[rows, g * S + fill_RG[rows, g]] = e
        fill_RG[rows, g] += 1
        load_RG[rows, g] += per[rows, e]
        holds_REG[rows, e, g] = True
    for r in np.flatnonzero(stuck):
        phy[r] = plain.rounds(per[r], count[r], G, S)
    return phy


def _gpu_loads(w_RGS):
    """Each GPU's load summed slot by slot (the kernels' order, exact to the bit), [R, G]."""
    gl = w_RGS[:, :, 0].copy()
    for s in range(1, w_RGS.shape[2]):
        gl += w_RGS[:, :, s]
    return gl


def refine(phy_RP, per_RE, G: int, max_swaps: int, settle: bool, gap: float) -> int:
    """The kernel's `refine` (in place on phy_RP); returns the swaps made."""
    R, P = phy_RP.shape
    S = P // G
    per = np.asarray(per_RE, dtype=np.float64)
    w = np.take_along_axis(per, phy_RP, axis=1)
    gl = _gpu_loads(w.reshape(R, G, S))
    stop = np.maximum(np.cumsum(w, axis=1)[:, -1] / G, w.max(axis=1)) * (1.0 + gap + 1e-12)
    active = np.arange(R)
    swaps = 0
    for _ in range(max_swaps):
        if active.size == 0 or G < 2:
            break
        pick = _best_swaps(phy_RP[active], per[active], gl[active], G, S, settle)
        h, top = pick[0], pick[1]
        go = (top > stop[active]) & (pick[2] >= 0)
        rows, a, b, h = active[go], pick[2][go], pick[3][go], h[go]
        if rows.size == 0:
            break
        ea, eb = phy_RP[rows, a], phy_RP[rows, b]
        d = per[rows, ea] - per[rows, eb]
        phy_RP[rows, a], phy_RP[rows, b] = eb, ea
        gl[rows, h] -= d
        gl[rows, b // S] += d
        swaps += rows.size
        active = rows
    return swaps


def _best_swaps(phy, per, gl, G, S, settle):
    """(h, top, slot a, slot b) per row: the swap the kernel's `_best_swap` picks (a = -1: none)."""
    A = phy.shape[0]
    ar = np.arange(A)
    order = np.lexsort((np.arange(G)[None, :].repeat(A, 0), gl), axis=1)   # load ascending, index on ties
    h = order[:, -1]
    top = gl[ar, h]
    second = gl[ar, order[:, -2]] if settle else np.full(A, -np.inf)
    w_AGS = np.take_along_axis(per, phy, axis=1).reshape(A, G, S)
    srt = np.argsort(w_AGS, axis=2, kind="stable")                          # slots by load, lower first
    ws = np.take_along_axis(w_AGS, srt, axis=2)
    e_AGS = np.take_along_axis(phy.reshape(A, G, S), srt, axis=2)
    holds = np.zeros((A, per.shape[1], G), dtype=bool)
    holds[ar[:, None, None], phy.reshape(A, G, S), np.arange(G)[None, :, None]] = True
    part = order[:, :-1]                                                    # lighter GPUs, lightest first [A, I]
    lg = gl[ar[:, None], part]
    wa = ws[ar, h][:, None, :, None]                                        # [A, 1, S, 1]
    ea = e_AGS[ar, h]                                                       # [A, S]
    wb = ws[ar[:, None], part][:, :, None, :]                               # [A, I, 1, S]
    eb = e_AGS[ar[:, None], part]                                           # [A, I, S]
    t4, lg4 = top[:, None, None, None], lg[:, :, None, None]
    t = wa - 0.5 * (t4 - lg4)
    heavy = wb >= t
    value = np.where(heavy, (t4 - wa) + wb, (lg4 + wa) - wb)
    ok = (wb < wa) & ~holds[ar[:, None, None], ea[:, None, :], part[:, :, None]][..., None]
    ok &= ~holds[ar[:, None, None], eb, h[:, None, None]][:, :, None, :]
    ok &= value < (top * (1.0 - 1e-9))[:, None, None, None]
    value = np.where(ok, value, np.inf)
    # Scan order within a GPU: h's replicas lightest first; for each, the heavier partners
    # upward, then the lighter ones downward (the first feasible of each direction is its lowest).
    j = (~heavy).sum(axis=3, keepdims=True)                                 # partners below the ideal
    jj = np.arange(S)[None, None, None, :]
    rank = np.where(heavy, jj - j, S + (j - 1 - jj))
    pos = (np.arange(S)[None, None, :, None] * 2 * S + rank).reshape(A, G - 1, S * S)
    flat = value.reshape(A, G - 1, S * S)
    m_AI = flat.min(axis=2)                                                 # each GPU's best
    first = np.where(flat == m_AI[..., None], pos, np.iinfo(np.int64).max).argmin(axis=2)
    run = np.minimum.accumulate(m_AI, axis=1)
    # Settling: GPUs are scanned until the best so far is at or below the second-busiest.
    done = np.isfinite(run) & (run <= second[:, None])
    k = np.where(done.any(axis=1), done.argmax(axis=1), G - 2)              # last GPU scanned
    scanned = np.arange(G - 1)[None, :] <= k[:, None]
    i = np.where(scanned, m_AI, np.inf).argmin(axis=1)                      # first of the lowest
    found = np.isfinite(m_AI[ar, i])
    c = first[ar, i]
    ia, jx = c // S, c % S
    a_slot = h * S + srt[ar, h, ia]
    g = part[ar, i]
    b_slot = g * S + srt[ar, g, jx]
    return h, top, np.where(found, a_slot, -1), b_slot


def plan_greedy(load_LE, num_gpus: int, slots_per_gpu: int, refine_rounds=None, count_LE=None,
                refine_gap: float = 0.0) -> np.ndarray:
    """`planners.greedy.plan_greedy` from the three numpy steps."""
    load = np.asarray(load_LE, dtype=np.float64)
    G, S = int(num_gpus), int(slots_per_gpu)
    P = G * S
    count = replicate(load, P, G) if count_LE is None else np.asarray(count_LE, dtype=np.int64)
    per = load / count
    phy = pack(per, count, G, S)
    cap = 4 * P if refine_rounds is None else int(refine_rounds)
    if cap > 0:
        refine(phy, per, G, cap, refine_rounds is None, float(refine_gap))
    return phy
