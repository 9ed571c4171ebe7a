"""Compiled round-start priorities of the migration schedule (numba): chains and senders.

Legend: L = MoE layers, E = logical experts, G = ranks, S = slots per rank, P = G x S slots.

Stages of `_schedule_kernel.schedule`, inlined into it:
- `forced_sources`: pending slots whose target only one other rank holds (that rank must
  send it), counted per rank: a priority of the link matching (`_links_kernel`);
- `chain_order`: a slot holding the last replica of its expert waits until that expert has
  landed where it goes; such waits form chains that unwind one copy per round. Each rank's
  queue is ordered by the chain its slots head, longest first. Each slot's link in a chain
  is kept from round to round and recomputed where `touch` marked its target's holders changed.
`st` is the schedule's state (`_state_kernel._Slots`), `sg` the staging scratch
(`_cycles_kernel._Staging`).
"""

from __future__ import annotations

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
