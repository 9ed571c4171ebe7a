"""Compiled source plan of the migration schedule (numba): who sends each network copy.

Legend: L = MoE layers, E = logical experts, G = ranks, S = slots per rank, P = G x S slots.

A stage of `_schedule_kernel.schedule` in its relay mode (`schedule.py` runs that mode only
where the plain rounds exceed the round bound by more than `RELAY_GATE`). A rank sends at most
one expert per round, and on large clusters (two slots per GPU) nearly every rank sends and
receives in every round, so the sends must be spread as evenly as the receives: with only
the ranks that hold an expert at the start as sources the busiest rank must send more often
than the busiest one receives. `plan_sources` gives each pending network copy a planned
source rank, balanced, where a rank that has just received an expert (a relay) counts as a
source of the later copies of it; the link matching (`_links_kernel`) tries the planned
source first and covers the ranks with the most planned sends left. `st` is the schedule's
state (`_state_kernel._Slots`).
"""

from __future__ import annotations

import numpy as np

from eplb.core.jit import kernel


@kernel(inline=True)
def _pending_copies(st, c0, c1, S, P, fsrc):
    """The network copies pending in layers c0..c1-1 (codes l * P + p, whose rank holds no
    replica of the target and whose target some rank holds), with the ranks holding each
    one's target: (codes, nhold, hptr, hranks); copy i's ranks are hranks[hptr[i]:hptr[i + 1]].
    Clears fsrc for the chunk."""
    E = st.hc.shape[1]
    G = st.npend.size
    n = 0
    nh = 0
    for l in range(c0, c1):
        for p in range(P):
            fsrc[l, p] = -1
            if st.cur[l, p] != st.tgt[l, p]:
                n += 1
                nh += min(G, st.ncur[l, st.tgt[l, p]])
    codes = np.empty(n, dtype=np.int64)
    nhold = np.empty(n, dtype=np.int64)
    hptr = np.zeros(n + 1, dtype=np.int64)
    hranks = np.empty(nh, dtype=np.int64)
    m = 0
    for l in range(c0, c1):
        for p in range(P):
            e = st.tgt[l, p]
            if st.cur[l, p] == e:
                continue
            j0 = hptr[m]
            j = j0
            own = False
            h = st.hhead[l * E + e]
            while h >= 0:
                r = (h - l * P) // S
                if r == p // S:
                    own = True
                    break
                t = j0
                while t < j and hranks[t] != r:
                    t += 1
                if t == j:
                    hranks[j] = r
                    j += 1
                h = st.hnext[h]
            if own or j == j0:
                continue               # a local copy, or a checkpoint reload: no send
            codes[m] = l * P + p
            nhold[m] = j - j0
            hptr[m + 1] = j
            m += 1
    return codes[:m], nhold[:m], hptr[:m + 1], hranks


@kernel
def plan_sources(st, c0, c1, S, P, fsrc, rout):
    """Plan a source rank for each pending network copy of layers c0..c1-1: fsrc[l, p] = that
    rank (-1: none planned), rout[g] = the sends planned on rank g.

    The copies of the experts held on the fewest ranks are placed first (one holder: forced),
    each on the rank with the fewest planned sends among those holding its expert now and
    those an earlier copy of the same expert lands on (a relay: the slot keeps it, being in
    its final state). A second slot of one rank waiting for the same expert plans no send (it
    copies locally once the first has landed). Called at a round's start (every replica
    complete); the schedule lowers rout as planned copies land. Then `_level` moves planned
    sends off the ranks planned above the most network copies one rank still receives (no
    fewer rounds are left) where another choice has room."""
    E = st.hc.shape[1]
    for g in range(rout.size):
        rout[g] = 0
    codes, nhold, hptr, hranks = _pending_copies(st, c0, c1, S, P, fsrc)
    m = codes.size
    # By holder count, then (layer, expert) groups, then slot: a group's copies run together.
    gkey = np.empty(m, dtype=np.int64)
    for i in range(m):
        l = codes[i] // P
        gkey[i] = (nhold[i] * (c1 - c0) * E + (l - c0) * E + st.tgt[l, codes[i] % P]) * P + codes[i] % P
    order = np.argsort(gkey)
    # Copy order[k]'s relay choices: the ranks of the earlier copies of its group,
    # dst[gfirst[k]:k] (a relay planned only from an earlier copy keeps the plan a forest).
    dst = np.empty(m, dtype=np.int64)
    gfirst = np.empty(m, dtype=np.int64)
    assign = np.full(m, -1, dtype=np.int64)
    nrecv = np.zeros(rout.size, dtype=np.int64)
    prev = -1
    g0 = 0
    for k in range(m):
        i = order[k]
        if gkey[i] // P != prev:
            prev = gkey[i] // P
            g0 = k
        gfirst[k] = g0
        d = (codes[i] % P) // S
        dst[k] = d
        dup = False
        for t in range(g0, k):
            if dst[t] == d:
                dup = True
        if dup:
            continue
        nrecv[d] += 1
        best = -1
        for t in range(hptr[i], hptr[i + 1]):
            if best < 0 or rout[hranks[t]] < rout[best]:
                best = hranks[t]
        for t in range(g0, k):
            if assign[t] >= 0 and rout[dst[t]] < rout[best]:
                best = dst[t]
        assign[k] = best
        rout[best] += 1
    cap = max(nrecv.max() if nrecv.size else 0, (rout.sum() + rout.size - 1) // max(rout.size, 1))
    _level(order, dst, gfirst, assign, hptr, hranks, rout, cap)
    for k in range(m):
        if assign[k] >= 0:
            fsrc[codes[order[k]] // P, codes[order[k]] % P] = assign[k]


@kernel(inline=True)
def _level(order, dst, gfirst, assign, hptr, hranks, rout, cap):
    """Move planned sends off the ranks with more than cap along augmenting paths (a send moves
    from rank u to another of its choices v, whose own send moves on, ... to a rank below cap),
    until none is above cap or no path is left: the greedy's plan, levelled."""
    G = rout.size
    m = order.size
    # Copies by planned rank: linked lists.
    head = np.full(G, -1, dtype=np.int64)
    nxt = np.full(m, -1, dtype=np.int64)
    prv = np.full(m, -1, dtype=np.int64)
    for k in range(m):
        r = assign[k]
        if r >= 0:
            nxt[k] = head[r]
            if head[r] >= 0:
                prv[head[r]] = k
            head[r] = k
    seen = np.zeros(G, dtype=np.int64)
    via = np.empty(G, dtype=np.int64)       # the copy whose move reached a rank
    queue = np.empty(G, dtype=np.int64)
    mark = 0
    for u0 in np.argsort(-rout, kind="mergesort"):
        while rout[u0] > cap:
            mark += 1
            seen[u0] = mark
            queue[0] = u0
            qh, qt = 0, 1
            end = -1
            while qh < qt and end < 0:
                u = queue[qh]
                qh += 1
                k = head[u]
                while k >= 0 and end < 0:
                    i = order[k]
                    # k's choices: the holders, then (not the group's first copy) the earlier copies' ranks.
                    nh = hptr[i + 1] - hptr[i]
                    for t in range(nh + k - gfirst[k]):
                        if t < nh:
                            v = hranks[hptr[i] + t]
                        else:
                            q = gfirst[k] + t - nh
                            if assign[q] < 0:
                                continue
                            v = dst[q]
                        if seen[v] == mark:
                            continue
                        seen[v] = mark
                        via[v] = k
                        if rout[v] < cap:
                            end = v
                            break
                        queue[qt] = v
                        qt += 1
                    k = nxt[k]
            if end < 0:
                return                      # no path: the plan stays as levelled as it is
            v = end
            while v != u0:                  # move each copy on the path to the rank it reached
                k = via[v]
                u = assign[k]
                unlink(head, nxt, prv, u, k)
                assign[k] = v
                prv[k] = -1
                nxt[k] = head[v]
                if head[v] >= 0:
                    prv[head[v]] = k
                head[v] = k
                v = u
            rout[u0] -= 1
            rout[end] += 1


@kernel(inline=True)
def unlink(head, nxt, prv, i, k):
    """Take item k out of list i of a doubly linked set of lists (head[i] its first item, nxt /
    prv the links; -1 ends a list)."""
    a = prv[k]
    b = nxt[k]
    if a >= 0:
        nxt[a] = b
    else:
        head[i] = b
    if b >= 0:
        prv[b] = a
