"""Who sends what, in the migration schedule's rounds (numba): priorities and sources.

Legend: L = MoE layers, E = logical experts, G = ranks, S = slots per rank, P = G x S slots.

Stages of `_rounds_kernel.schedule`, inlined into it:
- `forced_sources`: pending slots whose target only one other rank holds (that rank must
  send it), counted per rank: a priority of the link matching (`_links_kernel`);
- `chain_order`: a slot holding the last replica of its expert waits until that expert has
  landed where it goes; such waits form chains that unwind one copy per round. Each rank's
  queue is ordered by the chain its slots head, longest first. Each slot's link in a chain
  is kept from round to round and recomputed where `touch` marked its target's holders changed;
- `plan_sources` (the relay mode only: `rounds.py` runs it where the plain rounds exceed the
  round bound by more than `RELAY_GATE`): a rank sends at most one expert per round, and on
  large clusters (two slots per GPU) nearly every rank sends and receives in every round, so
  the sends must be spread as evenly as the receives. Each pending network copy gets a
  planned source rank, balanced, where a rank that has just received an expert (a relay)
  counts as a source of its later copies; the link matching tries the planned source first
  and covers the ranks with the most planned sends left.
`st` is the schedule's state (`_state_kernel._Slots`), `sg` the staging scratch
(`_cycles_kernel._Staging`).
"""

from __future__ import annotations

import numpy as np

from eplb.core.jit import kernel
from eplb.migration.schedule._cycles_kernel import is_deadlock


@kernel(inline=True)
def forced_sources(st, c0, c1, S, P, fsrc, rout, nh, hr):
    """For the chunk's pending slots whose expert only one rank holds (and not their own):
    fsrc[l, p] = that rank, which must send it; rout counts them per rank (a priority of the
    link matching, lowered as the copies land; replicas made meanwhile are not counted)."""
    for g in range(rout.size):
        rout[g] = 0
    for l in range(c0, c1):
        for e in range(nh.size):
            nh[e] = 0
        for p in range(P):
            e = st.cur[l, p]
            if e >= 0 and (nh[e] == 0 or hr[e] != p // S):
                nh[e] += 1
                hr[e] = p // S
        for p in range(P):
            fsrc[l, p] = -1
            e = st.tgt[l, p]
            if st.cur[l, p] == e or nh[e] != 1 or hr[e] == p // S:
                continue
            fsrc[l, p] = hr[e]
            rout[hr[e]] += 1


@kernel(inline=True)
def touch(st, le):
    """Expert le = l * E + e of the schedule's state st gained or lost a holder or a holder's
    staging mark: the chain order recomputes the links of the slots that want it."""
    if not st.dirty[le]:
        st.dirty[le] = True
        st.dlist[st.dn[0]] = le
        st.dn[0] += 1


@kernel(inline=True)
def _link(st, nxt, code, d, S, P, E):
    """The chain link of pending slot code = l * P + p on rank d at a round's start: the slot
    it lets be written (the only holder of its target; or a staging slot holding it, of two
    replicas), or -1, in nxt (flat sg.path_LP); and whether its rank holds its target (st.loc)."""
    l = code // P
    # At a round's start every replica is complete: e's only holder is hsum[l, e], and a slot
    # that does not hold its target is pending.
    e = st.tgt[l, code - l * P]
    n_e = st.hc[l, e]
    w = l * P + st.hsum[l, e] if n_e == 1 else -1
    local = False
    # The holders matter for a local source (only where one may exist) and for a staging slot
    # among two replicas.
    h = st.hhead[l * E + e] if st.mayloc[l, code - l * P] or (n_e == 2 and st.nstaged[0] > 0) else -1
    lo = l * P + d * S
    while h >= 0:
        if lo <= h < lo + S:
            local = True
        # A staging slot holding e (of two replicas) is freed only once code takes e: its
        # chain waits on code.
        if n_e == 2 and st.staged_exp[l, h - l * P] == e and st.staged_blk[l, h - l * P] >= 0:
            w = h
        h = st.hnext[h]
    nxt[code] = w if w >= 0 and st.tgt[l, w - l * P] != e else -1
    st.loc[l, code - l * P] = local


@kernel(inline=True)
def chain_order(st, sg, S, P, depth, key, rin):
    """At the start of a round: order each rank's pending slots by the chain each one heads,
    longest first; rin[d] = the copies rank d must still receive over a link (its pending
    slots whose target it holds in no slot), raised to the longest chain on rank d (both
    bound the rounds left). Returns the number n of deadlocked cycles of blocked slots (those
    `stage` would break), one slot of each in sg.cyc_start[:n].

    Writing slot q lets the slot holding the last complete replica of q's target be written
    (it waits for that replica), and so on: chains of waits that unwind one copy per round.
    A staging slot holding q's target (one of its two replicas) waits on q too: it is freed
    only once q has taken the expert, so the chain it heads counts in q's depth.
    A long chain left to the end of the queues leaves a tail of rounds with one copy each.
    A chain that closes into a cycle is a deadlock when `stage` would follow it backwards
    (`_cycles_kernel.is_deadlock`); every deadlock at a round's start is such a cycle."""
    pend, npend, G = st.pend, st.npend, st.npend.size
    E = st.hc.shape[1]
    # Flat views (index l * P + p, l * E + e): the loops below visit every pending slot each round.
    dep = depth.reshape(-1)
    nxt = sg.path_LP.reshape(-1)          # the slot each pending slot waits on, or -1
    loc = st.loc.reshape(-1)
    # A slot's link and local source depend only on the holders of its target and their staging
    # marks: recomputed for the slots of the experts whose holders changed since the last round
    # (`touch`), all of them when a chunk starts.
    if st.dn[1]:
        for d in range(G):
            for k in range(npend[d]):
                _link(st, nxt, pend[d, k], d, S, P, E)
    else:
        for i in range(st.dn[0]):
            le = st.dlist[i]
            l = le // E
            for j in range(sg.want_ptr[le], sg.want_ptr[le + 1]):
                q = sg.want[j]
                if st.inpend[l, q]:
                    _link(st, nxt, l * P + q, q // S, S, P, E)
    for i in range(st.dn[0]):
        st.dirty[st.dlist[i]] = False
    st.dn[0] = 0
    st.dn[1] = 0
    # (The depths of the pending slots are -1 here: `_requeue` cleared them.)
    ncyc = 0                              # cycles closed, one slot of each in sg.cyc_start
    for d in range(G):
        for k in range(npend[d]):
            code = pend[d, k]
            # Walk the chain from code to its end (or to a slot already measured), then set depths back.
            n = 0
            q = code
            while q >= 0 and dep[q] == -1:
                dep[q] = -2 - n         # on the walk, n steps from its start
                n += 1
                q = nxt[q]
            if q >= 0 and dep[q] < -1:
                sg.cyc_start[ncyc] = q
                ncyc += 1
            end = dep[q] if q >= 0 and dep[q] >= 0 else 0
            q = code
            for t in range(n):
                dep[q] = end + n - t
                q = nxt[q]
                if q < 0 or dep[q] >= 0:
                    break
    for d in range(G):
        n = npend[d]
        longest = 0
        remote = 0
        for k in range(n):
            key[k] = dep[pend[d, k]]
            longest = max(longest, key[k])
            if not loc[pend[d, k]]:
                remote += 1
        rin[d] = max(remote, longest)
        for a in range(1, n):             # insertion sort by depth, descending, stable
            code = pend[d, a]
            v = key[a]
            b = a
            while b > 0 and key[b - 1] < v:
                pend[d, b] = pend[d, b - 1]
                key[b] = key[b - 1]
                b -= 1
            pend[d, b] = code
            key[b] = v
    n = 0
    for c in range(ncyc):
        if is_deadlock(st, sg, sg.cyc_start[c], S, P):
            sg.cyc_start[n] = sg.cyc_start[c]
            n += 1
    return n

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
