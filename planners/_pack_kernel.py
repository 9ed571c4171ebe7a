"""Compiled greedy packing (numba): longest-processing-time with a slot limit, one row at a time.

Legend: R = rows (layers, or layers x nodes for node-local packing), E = logical experts,
G = GPUs of a row, S = slots per GPU, P = G x S slots. Slot p of a row lives on GPU p // S.

`pack` hands the replicas out heaviest first, each to the lightest GPU (ties: lower GPU index)
with a free slot that does not hold its expert, so an expert's c replicas take the c lightest
open GPUs. While the heaviest replicas go out that is what S rounds do (round k hands the next
G replicas to the GPUs in load order, one each), and rounds are cheaper: they run until the
first replica LPT would place otherwise (on skewed loads, often none), and LPT goes on from
there. Where LPT is left with an expert whose replicas outnumber the GPUs with free slots, the
row is packed in rounds, which always fit (an expert straddles two rounds at most). The code
is plain loops over scalars (see planners/_greedy_kernel.py); every kernel trusts its input
and releases the GIL.
"""

from __future__ import annotations

import numpy as np

from eplb.core.jit import kernel


@kernel
def _ties_by_id(key, order, n):
    """Sort each run of equal keys in order[:n] by index (an unstable sort left them in any order)."""
    i = 0
    while i < n:
        j = i + 1
        while j < n and key[order[j]] == key[order[i]]:
            j += 1
        for a in range(i + 1, j):
            x = order[a]
            b = a
            while b > i and order[b - 1] > x:
                order[b] = order[b - 1]
                b -= 1
            order[b] = x
        i = j


@kernel(inline=True)
def _before(gl, a, b):
    """Does GPU a come before GPU b in load order (lighter, then the lower index)?"""
    return gl[a] < gl[b] or (gl[a] == gl[b] and a < b)


@kernel
def _sort_gpus(gl, gorder, G):
    """Insertion-sort gorder[:G] by load ascending, lower index among ties (cheap when the order
    is nearly right already)."""
    for a in range(1, G):
        g = gorder[a]
        b = a
        while b > 0 and _before(gl, g, gorder[b - 1]):
            gorder[b] = gorder[b - 1]
            b -= 1
        gorder[b] = g


@kernel(inline=True)
def _replicas(per_E, cnt_E, order_E, order, rep):
    """rep[:P] = each expert's replicas, heaviest first (order_E, with ties put in id order in
    the scratch order [E])."""
    E = per_E.size
    for i in range(E):
        order[i] = order_E[i]
    _ties_by_id(per_E, order, E)
    n = 0
    for i in range(E):
        e = order[i]
        for _ in range(cnt_E[e]):
            rep[n] = e
            n += 1


@kernel(inline=True)
def _place_round(per_E, rep, base, G, S, k, phy, gl, gorder, last):
    """Round k: replica rep[base + j] to GPU gorder[j]."""
    for j in range(G):
        g = gorder[j]
        e = rep[base + j]
        phy[g * S + k] = e
        gl[g] += per_E[e]
        last[e] = k


@kernel
def _lpt_agrees(s, G, gl, gl0, gorder):
    """Did round k (placed from loads gl0) give every run of one expert's replicas the GPUs
    LPT would: the c lightest open ones (before the last round every GPU is open)? The round
    gives a run the next c GPUs it has not served; LPT agrees while the lightest GPU an
    earlier run served (its new load) comes after them (their old loads). Along the round the
    lightest served GPU can only get lighter and the next GPUs only heavier, so the last run
    alone decides: s is where it starts (> 0)."""
    m = gorder[0]
    for i in range(1, s):
        if _before(gl, gorder[i], m):
            m = gorder[i]
    h = gorder[G - 1]
    return gl[m] > gl0[h] or (gl[m] == gl0[h] and m > h)


@kernel
def _round_until_lpt_differs(per_E, rep, base, G, S, k, phy, gl, gorder, last):
    """Round k run by run until a run's GPUs differ from LPT's (see `_lpt_agrees`): returns
    that run's start (nothing of it placed), or base + G."""
    lpt = -1           # the lightest GPU an earlier run served
    run = -1           # the lightest GPU of the current run
    for j in range(G):
        e = rep[base + j]
        if j > 0 and e != rep[base + j - 1]:
            if lpt < 0 or _before(gl, run, lpt):
                lpt = run
            run = -1
            c = 1
            while j + c < G and rep[base + j + c] == e:
                c += 1
            if _before(gl, lpt, gorder[j + c - 1]):
                return base + j
        g = gorder[j]
        phy[g * S + k] = e
        gl[g] += per_E[e]
        last[e] = k
        if run < 0 or _before(gl, g, run):
            run = g
    return base + G


@kernel
def _rounds(per_E, rep, G, S, phy, gl, gl0, gorder, chosen, last, guard):
    """Place the replicas rep[:P] of one row in S rounds (the module docstring). With guard,
    stop where a run of one expert's replicas would get other GPUs than longest-processing-
    time's and return the run's start (nothing of it placed); P when none does. After round k
    every GPU holds k + 1 replicas."""
    for e in range(per_E.size):
        last[e] = -1
    for g in range(G):
        gl[g] = 0.0
        gorder[g] = g
    for k in range(S):
        if k > 0:
            # The lightest GPUs took the heaviest replicas: the reversed order is nearly sorted.
            for j in range(G // 2):
                x = gorder[j]
                gorder[j] = gorder[G - 1 - j]
                gorder[G - 1 - j] = x
            _sort_gpus(gl, gorder, G)
        lightest = gl[gorder[0]]
        base = k * G
        first = rep[base]
        if k > 0 and last[first] == k - 1:
            # Only the expert that opens round k can sit on a GPU already (from round k - 1):
            # its m replicas here take the m lightest GPUs that do not hold it yet, and the
            # other GPUs follow in their load order.
            m = 0
            while m < G and rep[base + m] == first:
                m += 1
            free = 0
            held = 0
            for j in range(G):
                g = gorder[j]
                if free < m and phy[g * S + k - 1] != first:
                    chosen[free] = g
                    free += 1
                else:
                    gorder[held] = g
                    held += 1
            for j in range(held - 1, -1, -1):
                gorder[free + j] = gorder[j]
            for j in range(free):
                gorder[j] = chosen[j]
        if not guard or k == S - 1:  # the last round fills every slot, as LPT does
            _place_round(per_E, rep, base, G, S, k, phy, gl, gorder, last)
            continue
        s = G - 1  # the round's last run starts at s
        while s > 0 and rep[base + s - 1] == rep[base + G - 1]:
            s -= 1
        if s == 0 or lightest + per_E[rep[base + s - 1]] > gl[gorder[G - 1]]:
            # Every GPU an earlier run serves ends heavier than any the round has yet to serve
            # (loads + replicas fall along the round): LPT agrees, no need to look.
            _place_round(per_E, rep, base, G, S, k, phy, gl, gorder, last)
            continue
        for g in range(G):
            gl0[g] = gl[g]
        _place_round(per_E, rep, base, G, S, k, phy, gl, gorder, last)
        if _lpt_agrees(s, G, gl, gl0, gorder):
            continue
        for g in range(G):  # find the run where LPT parts from the round
            gl[g] = gl0[g]
        return _round_until_lpt_differs(per_E, rep, base, G, S, k, phy, gl, gorder, last)
    return G * S


@kernel
def _lpt_from(per_E, rep, n, G, S, phy, gl, fill, q, took):
    """Longest-processing-time for the replicas rep[n:P] of one row, from a partial placement
    (gl, fill: each GPU's load and filled slots; no GPU holds rep[n]'s expert yet): each run
    of one expert's c replicas takes the c lightest GPUs with a free slot. False where fewer
    than c GPUs have one (phy is then partial). q: scratch of G + P + 1, open GPUs in load
    order in q[head:tail]."""
    P = G * S
    tail = 0
    for g in range(G):
        if fill[g] < S:
            q[tail] = g
            tail += 1
    _sort_gpus(gl, q, tail)  # few GPUs are out of order where the rounds stop
    head = 0
    while n < P:
        e = rep[n]
        c = 1
        while n + c < P and rep[n + c] == e:
            c += 1
        if c > tail - head:
            return False
        w = per_E[e]
        for k in range(c):
            g = q[head + k]
            took[k] = g
            phy[g * S + fill[g]] = e
            fill[g] += 1
            gl[g] += w
        head += c
        for k in range(c):
            g = took[k]
            if fill[g] == S:
                continue
            lo = head          # its place: the first open GPU that comes after it
            hi = tail
            while lo < hi:
                mid = (lo + hi) >> 1
                if _before(gl, q[mid], g):
                    lo = mid + 1
                else:
                    hi = mid
            if lo - head <= tail - lo and head > 0:
                for j in range(head, lo):  # shift the lighter ones into the free cell in front
                    q[j - 1] = q[j]
                head -= 1
                q[lo - 1] = g
            else:
                for j in range(tail, lo, -1):
                    q[j] = q[j - 1]
                tail += 1
                q[lo] = g
        n += c
    return True


@kernel
def pack(per_RE, cnt_RE, order_RE, G, S):
    """phy2log int64 [R, P]: cnt_RE[r, e] replicas of load per_RE[r, e] each, longest-
    processing-time with a slot limit (see the module docstring). order_RE: each row's experts
    by per_RE descending (any order among ties: they are put in id order here). Each row's
    counts sum to P and none exceeds G (a count of 0 places nothing)."""
    R, E = per_RE.shape
    P = G * S
    phy = np.empty((R, P), dtype=np.int64)
    order = np.empty(E, dtype=np.int64)
    rep = np.empty(P, dtype=np.int64)
    last = np.empty(E, dtype=np.int64)
    gl = np.empty(G)
    gl0 = np.empty(G)
    gorder = np.empty(G, dtype=np.int64)
    chosen = np.empty(G, dtype=np.int64)
    fill = np.empty(G, dtype=np.int64)
    q = np.empty(G + P + 1, dtype=np.int64)
    for r in range(R):
        per_E = per_RE[r]
        _replicas(per_E, cnt_RE[r], order_RE[r], order, rep)
        phy_P = phy[r]
        n = _rounds(per_E, rep, G, S, phy_P, gl, gl0, gorder, chosen, last, True)
        if n == P:
            continue
        k = n // G  # the round it stopped in: GPUs it served there hold one replica more
        for g in range(G):
            fill[g] = k
        for i in range(k * G, n):
            fill[gorder[i - k * G]] += 1
        if not _lpt_from(per_E, rep, n, G, S, phy_P, gl, fill, q, chosen):
            # A few GPUs kept free slots for an expert with more replicas than them: the
            # rounds always fit (an expert straddles two rounds at most).
            _rounds(per_E, rep, G, S, phy_P, gl, gl0, gorder, chosen, last, False)
    return phy
