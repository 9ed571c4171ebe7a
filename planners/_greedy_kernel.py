"""Compiled greedy planning (numba): replicate, pack and refine, one row at a time.

Legend: R = rows (layers, or layers x nodes for node-local packing), E = logical experts,
G = GPUs of a row, S = slots per GPU, P = G x S slots. Slot p of a row lives on GPU p // S.

- `replicate`: replica counts per row, each next slot to the expert with the highest load per
  replica (a heap; ties: fewer replicas, then the lower expert id);
- `pack`: longest-processing-time with a slot limit (planners/_pack_kernel.py);
- `refine`: swaps of a replica on the busiest GPU with one on a lighter GPU while one lowers
  the busiest GPU: the lighter GPUs are tried lightest first, each with the swap that leaves
  the pair's larger load lowest, and the best of all is made; when settling (refining until
  no swap helps), the first that leaves the pair at or below the second-busiest GPU is
  (`GreedyPlanner` runs the three in turn, planners/greedy.py).
The code is plain loops over scalars (no numpy sorting or slicing inside): numba compiles such
code in a fraction of the time its array library takes, and only the first process after an
install compiles (`cache=True`). Every kernel trusts its input (planners/greedy.py checks it)
and releases the GIL.
"""

from __future__ import annotations

import numpy as np

from eplb.core.jit import kernel
from planners._pack_kernel import pack  # noqa: F401  (the greedy steps live here as one set)


@kernel(inline=True)
def _first(v_a, a, v_b, b, cnt):
    """Does expert a (load per replica v_a) get the next slot before b (v_b): higher load per
    replica, then fewer replicas, then the lower id."""
    if v_a != v_b:
        return v_a > v_b
    if cnt[a] != cnt[b]:
        return cnt[a] < cnt[b]
    return a < b


@kernel(inline=True)
def _sift(key, heap, cnt, n, i, v, e):
    """Put expert e (load per replica v) at position i of the heap heap[:n] (`_first` on
    top) and let it sink; key[j] is the load per replica of heap[j], kept beside it so a
    comparison reads neighbouring values, and the children it passes move up into the hole."""
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and _first(key[c + 1], heap[c + 1], key[c], heap[c], cnt):
            c += 1
        if not _first(key[c], heap[c], v, e, cnt):
            break
        heap[i] = heap[c]
        key[i] = key[c]
        i = c
    heap[i] = e
    key[i] = v


@kernel
def _replicate_row(load_E, P, G, cnt_E, key_E, heap):
    """Replica counts of one row into cnt_E: sum P, 1 <= cnt <= G (key_E, heap: scratch)."""
    E = load_E.size
    for e in range(E):
        cnt_E[e] = 1
        key_E[e] = load_E[e]
        heap[e] = e
    n = E
    for i in range(n // 2 - 1, -1, -1):
        _sift(key_E, heap, cnt_E, n, i, key_E[i], heap[i])
    for _ in range(P - E):
        e = heap[0]
        cnt_E[e] += 1
        if cnt_E[e] >= G:
            n -= 1
            _sift(key_E, heap, cnt_E, n, 0, key_E[n], heap[n])
        else:
            _sift(key_E, heap, cnt_E, n, 0, load_E[e] / cnt_E[e], e)


@kernel
def replicate(load_RE, P, G):
    """Replica counts int64 [R, E] (each row sums to P, 1 <= count <= G) minimising each
    row's largest load per replica."""
    R, E = load_RE.shape
    cnt_RE = np.empty((R, E), dtype=np.int64)
    key_E = np.empty(E)
    heap = np.empty(E, dtype=np.int64)
    for r in range(R):
        _replicate_row(load_RE[r], P, G, cnt_RE[r], key_E, heap)
    return cnt_RE


@kernel
def _place(order, pos, gl, g, G):
    """Move GPU g to its place in order (ascending load, lower index among ties) after its
    load changed; pos is the inverse of order."""
    i = pos[g]
    lg = gl[g]
    while i > 0 and (gl[order[i - 1]] > lg or (gl[order[i - 1]] == lg and order[i - 1] > g)):
        order[i] = order[i - 1]
        pos[order[i]] = i
        i -= 1
    while i < G - 1 and (gl[order[i + 1]] < lg or (gl[order[i + 1]] == lg and order[i + 1] < g)):
        order[i] = order[i + 1]
        pos[order[i]] = i
        i += 1
    order[i] = g
    pos[g] = i


@kernel
def _sort_gpu_items(phy, per_E, g, S, srt, ws):
    """srt[g S:(g + 1) S] = GPU g's slots by the load of their replica, ascending, lower slot
    among ties (ws: the loads). Inserted last slot first: `pack` fills a GPU's slots heaviest
    first, so each insertion then ends at once."""
    o = g * S
    for n in range(S):
        p = o + S - 1 - n
        w = per_E[phy[p]]
        b = n                          # srt[o:o + n] holds the later slots, sorted
        while b > 0 and (ws[o + b - 1] > w or (ws[o + b - 1] == w and srt[o + b - 1] > p)):
            srt[o + b] = srt[o + b - 1]
            ws[o + b] = ws[o + b - 1]
            b -= 1
        srt[o + b] = p
        ws[o + b] = w


@kernel
def _resort_slot(phy, per_E, p, S, srt, ws):
    """Move slot p to its place in its GPU's list srt (ascending load, lower slot among ties,
    the order `_sort_gpu_items` makes) after its replica changed: O(S), not a fresh sort."""
    o = (p // S) * S
    i = 0
    while srt[o + i] != p:
        i += 1
    w = per_E[phy[p]]
    while i > 0 and (ws[o + i - 1] > w or (ws[o + i - 1] == w and srt[o + i - 1] > p)):
        srt[o + i] = srt[o + i - 1]
        ws[o + i] = ws[o + i - 1]
        i -= 1
    while i < S - 1 and (ws[o + i + 1] < w or (ws[o + i + 1] == w and srt[o + i + 1] < p)):
        srt[o + i] = srt[o + i + 1]
        ws[o + i] = ws[o + i + 1]
        i += 1
    srt[o + i] = p
    ws[o + i] = w


@kernel
def _refine_row(phy, per_E, G, S, max_swaps, settle, gap, holds, gl, order, pos, srt, ws):
    """`refine` on one row (phy [P] in place); returns the swaps made. Scratch: holds [E, G]
    (does the GPU hold the expert; all False on entry and on return), gl, order, pos [G], srt,
    ws [P] (`_sort_gpu_items`)."""
    stop = _row_loads(phy, per_E, G, S, gap, holds, gl)
    for g in range(G):
        _sort_gpu_items(phy, per_E, g, S, srt, ws)
    # GPUs by load, lower index among ties: a stable sort (placing each GPU in turn with
    # `_place` is O(G^2), most of a row's time at 256 GPUs, where few swaps help).
    order[:] = np.argsort(gl, kind="mergesort")
    for i in range(G):
        pos[order[i]] = i
    swaps = 0
    while swaps < max_swaps:
        h = order[G - 1]
        if gl[h] <= stop:
            break
        ba, bb = _best_swap(phy, G, S, settle, holds, gl, order, srt, ws)
        if ba < 0:
            break
        ea = phy[ba]
        eb = phy[bb]
        g = bb // S
        d = per_E[ea] - per_E[eb]
        phy[ba] = eb
        phy[bb] = ea
        gl[h] -= d
        gl[g] += d
        holds[ea, h] = False
        holds[eb, h] = True
        holds[eb, g] = False
        holds[ea, g] = True
        _resort_slot(phy, per_E, ba, S, srt, ws)
        _resort_slot(phy, per_E, bb, S, srt, ws)
        _place(order, pos, gl, h, G)
        _place(order, pos, gl, g, G)
        swaps += 1
    for g in range(G):  # holds is all False again for the next row (cheaper than clearing [E, G])
        for p in range(g * S, (g + 1) * S):
            holds[phy[p], g] = False
    return swaps


@kernel(inline=True)
def _row_loads(phy, per_E, G, S, gap, holds, gl):
    """Each GPU's load into gl and its experts into holds; returns the load at which swaps stop."""
    total = 0.0
    wmax = 0.0
    for g in range(G):  # slot by slot in order, without p // S (an integer division per slot)
        x = 0.0
        for p in range(g * S, (g + 1) * S):
            e = phy[p]
            x += per_E[e]
            holds[e, g] = True
            total += per_E[e]
            if per_E[e] > wmax:
                wmax = per_E[e]
        gl[g] = x
    # No placement of these replicas has a busiest GPU below the mean or the heaviest one;
    # swaps stop within `gap` of that floor (1e-12: rounding noise).
    return max(total / G, wmax) * (1.0 + gap + 1e-12)


@kernel(inline=True)
def _best_swap(phy, G, S, settle, holds, gl, order, srt, ws):
    """The swap (slot on the busiest GPU, slot on a lighter one) that leaves the pair's larger load
    lowest, lighter GPUs tried first; (-1, -1) when none lowers the busiest GPU."""
    h = order[G - 1]
    top = gl[h]
    oh = h * S
    # The best swap leaves max(top - d, lg + d) lowest, d = the load moved from h to g; it
    # must lower the busiest GPU by more than rounding noise.
    best = top * (1.0 - 1e-9)
    ba = -1
    bb = -1
    # Settling: once a GPU's best swap leaves the pair at or below the second-busiest GPU,
    # the row's busiest load after it is that GPU's, whichever swap is made: a better swap on
    # a later (heavier) GPU would not lower it, and scanning on for one costs as much as the
    # swap (about half the GPUs scanned, for a few more swaps; the plans end as balanced).
    # Under a cap on swaps each swap should do the most, so a capped refine takes the best.
    second = gl[order[G - 2]] if settle and G > 1 else -np.inf
    for i in range(G - 1):
        g = order[i]
        lg = gl[g]
        if ba >= 0 and best <= second:
            break
        if 0.5 * (top + lg) >= best:
            break                      # lighter GPUs came first: no later one can do better
        og = g * S
        if top - (ws[oh + S - 1] - ws[og]) >= best:
            continue                   # even its lightest replica cannot take enough load
        half = 0.5 * (top - lg)
        j = 0
        for ia in range(S):            # h's replicas, lightest first
            a = srt[oh + ia]
            if holds[phy[a], g]:
                continue
            wa = ws[oh + ia]
            t = wa - half              # the ideal partner's load: both GPUs end equal
            while j < S and ws[og + j] < t:
                j += 1
            # Partners at least as heavy as ideal: max = top - d, rising with their load.
            for jj in range(j, S):
                wb = ws[og + jj]
                if wb >= wa or top - wa + wb >= best:
                    break
                b = srt[og + jj]
                if not holds[phy[b], h]:
                    best = top - wa + wb
                    ba = a
                    bb = b
                    break
            # Lighter partners: max = lg + d, rising as their load falls.
            for jj in range(j - 1, -1, -1):
                wb = ws[og + jj]
                if lg + wa - wb >= best:
                    break
                b = srt[og + jj]
                if not holds[phy[b], h]:
                    best = lg + wa - wb
                    ba = a
                    bb = b
                    break
    return ba, bb


@kernel
def refine(phy_RP, per_RE, G, max_swaps, settle, gap):
    """Lower each row's busiest GPU by replica swaps, in place (at most max_swaps per row);
    returns the swaps made in all rows. Each replica of expert e carries per_RE[r, e]. settle:
    swaps go on until none helps (max_swaps only a guard), so each may be the first below the
    second-busiest GPU rather than the best (see the module docstring). gap: a row stops once
    its busiest GPU is within this fraction of the floor max(mean GPU load, heaviest replica)."""
    R, P = phy_RP.shape
    E = per_RE.shape[1]
    S = P // G
    holds = np.zeros((E, G), dtype=np.bool_)
    gl = np.empty(G)
    order = np.empty(G, dtype=np.int64)
    pos = np.empty(G, dtype=np.int64)
    srt = np.empty(P, dtype=np.int64)
    ws = np.empty(P)
    swaps = 0
    for r in range(R):
        swaps += _refine_row(phy_RP[r], per_RE[r], G, S, max_swaps, settle, gap, holds, gl, order, pos, srt, ws)
    return swaps
