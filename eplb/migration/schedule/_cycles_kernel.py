"""Compiled cycle finding of the migration schedule (numba): the deadlocks `stage` breaks.

Legend: L = MoE layers, E = logical experts, G = ranks, S = slots per rank, P = G x S slots.

Slot p is blocked when it holds the last complete replica of its expert o; it waits for the
first pending slot (in queue order) whose target is o. Each pending slot waits on at most one
other, so the waits form chains ending in a cycle or at a slot nobody waits for; a cycle whose
every member is blocked is a deadlock. `_find_cycles` walks every pending slot and lists every
cycle, in the order a walk over the queues meets it; `stage` (`_stage_kernel`) breaks the
deadlocks among them in that order. In a round whose start had no deadlock (`is_deadlock`,
called by the chain order) a deadlock can only appear through a replica the round's copies
overwrite, so `deadlocks` lists just those, in the same order, without the full pass
(`_find_cycles` walks every pending slot, and about a third of the rounds need a list); in a
round that starts with deadlocks, it walks from those the chain order found, too.
`st` is the schedule's state (`_state_kernel._Slots`), `sg` this module's scratch
(`_Staging`), `done` the round's transfer rows.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from eplb.core.jit import kernel

_Staging = namedtuple("_Staging", [
    "wf",           # first pending slot waiting for (l, e) (code l * P + p), valid where
    "wfs",          # ... wfs [L, E] is the walk's call number (sg.tally[2])
    "state",        # cycle walk: 2 x call on the path, 2 x call + 1 done, lower: not seen
    "path", "cyc_buf", "cyc_start", "cyc_len", "send_busy", "recv_busy",
    "want_ptr", "want",   # slots by target: want[want_ptr[l * E + e]:want_ptr[l * E + e + 1]], by slot
    "seen",         # `deadlocks`' walks: the walk that saw a slot last
    "tally",        # [0] `deadlocks`' walks so far, [1] the cycles listed for `stage`,
                    # [2] `_find_cycles`' calls so far, [3] `deadlocks`' calls, [4] in-tree searches
    "path_LP",      # [L, P] scratch of the schedule's chain order
    "member",       # [L, P] `deadlocks`' call (tally[3]) that listed the slot's cycle
    "tree",         # [L, P] the in-tree search (tally[4]) that reached the slot last
    "queue",        # [P] that search's queue
    "cyc_key",      # discovery key of each listed cycle (rank * L * S + queue position)
])


@kernel(inline=True)
def new_staging(new_LP, E, G):
    """Scratch of `stage` for the target new_LP [L, P] of E experts over G ranks."""
    L, P = new_LP.shape
    want_ptr = np.zeros(L * E + 1, dtype=np.int32)
    for l in range(L):
        for p in range(P):
            want_ptr[l * E + new_LP[l, p] + 1] += 1
    want_ptr = np.cumsum(want_ptr).astype(np.int32)
    fill = want_ptr[:-1].copy()
    want = np.empty(L * P, dtype=np.int32)
    for l in range(L):
        for p in range(P):
            want[fill[l * E + new_LP[l, p]]] = p
            fill[l * E + new_LP[l, p]] += 1
    # Slot codes, slots and offsets are int32 (below L x P, as the schedule's state:
    # `_state_kernel._new_state`); the walk and call stamps stay int64 (they count walks).
    return _Staging(np.full((L, E), -1, dtype=np.int32), np.zeros((L, E), dtype=np.int64),
                    np.zeros((L, P), dtype=np.int64), np.empty(P, dtype=np.int32),
                    np.empty(L * P, dtype=np.int32), np.empty(L * P, dtype=np.int32), np.empty(L * P, dtype=np.int32),
                    np.zeros(G, dtype=np.bool_), np.zeros(G, dtype=np.bool_), want_ptr, want,
                    np.full((L, P), -1, dtype=np.int64), np.zeros(5, dtype=np.int64),
                    np.empty((L, P), dtype=np.int32), np.zeros((L, P), dtype=np.int64),
                    np.zeros((L, P), dtype=np.int64), np.empty(P, dtype=np.int32), np.empty(L * P, dtype=np.int32))


@kernel
def _first_waiting(st, sg, l, o, S, P):
    """The pending slot that waits for expert o of layer l in `_find_cycles` (the first in
    queue order whose target is o), or -1."""
    return _waiter(st.inpend, sg.want_ptr, sg.want, st.pend, st.npend, l, o, S, P, sg.wf.shape[1])


@kernel
def is_deadlock(st, sg, code, S, P):
    """Is the cycle of chain links through pending slot code = l * P + q (sg.path_LP: the slot
    each pending slot waits on, as such codes, see `_senders_kernel.chain_order`) a
    deadlock `stage` breaks, at a round's start? Each member holds the only replica of the
    target of the member before it, so all are blocked; `_find_cycles` follows the cycle
    backwards when each member is the first slot in queue order waiting for the next one's
    expert."""
    nxt = sg.path_LP.reshape(-1)
    l = code // P
    a = code
    while True:
        b = nxt[a]
        if l * P + _first_waiting(st, sg, l, st.cur[l, b % P], S, P) != a:
            return False
        a = b
        if a == code:
            return True


@kernel(inline=True)
def _waiter(inpend, want_ptr, want, pend, npend, l, x, S, P, E):
    """The first pending slot in queue order whose target is expert x of layer l, or -1
    (`_first_waiting` on arrays: the walks below pass the state's arrays, not the state,
    which costs a reference count per use in numba's loops)."""
    best = -1
    for t in range(want_ptr[l * E + x], want_ptr[l * E + x + 1]):
        q = want[t]
        if not inpend[l, q]:
            continue
        if best < 0:
            best = q
        elif q // S == best // S:          # two on one rank: the earlier in its queue
            d = q // S
            for k in range(npend[d]):
                c = pend[d, k]
                if c == l * P + best:
                    break
                if c == l * P + q:
                    best = q
                    break
        else:
            break                          # slots by index: later ranks come later
    return best


@kernel
def _list_deadlocks(st, sg, pairs_N2, n, S, P, after):
    """List the deadlocked cycles through the pending holders of the experts pairs_N2[:n]
    ((layer, expert), each with < 2 complete replicas now) where `_find_cycles` would: a
    cycle is keyed by the first slot in queue order (rank, then position) whose chain of
    waits reaches it and written from the member that slot's walk meets first. Cycles keyed at
    or before listed cycle `after` are left out (`stage` is past them; -1: none). sg.cyc_*
    stays sorted by key, sg.tally[1] counts it; members are marked with tally[3]."""
    E = st.hc.shape[1]
    call = sg.tally[3]
    for i in range(n):
        l = pairs_N2[i, 0]
        h = st.hhead[l * E + pairs_N2[i, 1]]
        while h >= 0:
            m = h - l * P
            h = st.hnext[h]
            if not st.inpend[l, m] or sg.member[l, m] == call or not _closes(st, sg, l, m, S, P):
                continue
            first, key, clen = _keyed(st, sg, l, m, S, P)
            if after >= 0 and key <= sg.cyc_key[after]:
                continue
            _insert_cycle(st, sg, l, first, key, clen, S, P)


@kernel(inline=True)
def _closes(st, sg, l, m, S, P):
    """Does the chain of waits from pending slot m, every slot on it blocked, come back to m?"""
    E = st.hc.shape[1]
    sg.tally[0] += 1
    node = m
    while True:
        x = st.cur[l, node]
        if x < 0 or st.hc[l, x] >= 2:
            return False
        nxt = _waiter(st.inpend, sg.want_ptr, sg.want, st.pend, st.npend, l, x, S, P, E)
        if nxt == m:
            return True
        if nxt < 0 or sg.seen[l, nxt] == sg.tally[0]:
            return False
        sg.seen[l, nxt] = sg.tally[0]
        node = nxt


@kernel(inline=True)
def _keyed(st, sg, l, m, S, P):
    """The cycle through m: its members marked (tally[3]), then its in-tree (the slots whose
    chains reach it: w's waiters are the pending holders of w's target when w comes first for it);
    returns (the member the first in-tree slot in queue order meets first, that slot's queue key,
    the cycle's length)."""
    inpend, pend, npend, queue, tree = st.inpend, st.pend, st.npend, sg.queue, sg.tree
    E = st.hc.shape[1]
    G = npend.size
    call = sg.tally[3]
    node = m
    nq = 0
    while True:
        sg.member[l, node] = call
        queue[nq] = node
        nq += 1
        node = _waiter(inpend, sg.want_ptr, sg.want, pend, npend, l, st.cur[l, node], S, P, E)
        if node == m:
            break
    clen = nq
    sg.tally[4] += 1
    mark = sg.tally[4]
    for t in range(nq):
        tree[l, queue[t]] = mark
    dmin = G
    t = 0
    while t < nq:
        w = queue[t]
        t += 1
        dmin = min(dmin, w // S)
        x = st.tgt[l, w]
        if _waiter(inpend, sg.want_ptr, sg.want, pend, npend, l, x, S, P, E) != w:
            continue
        u = st.hhead[l * E + x]
        while u >= 0:
            if inpend[l, u - l * P] and tree[l, u - l * P] != mark:
                tree[l, u - l * P] = mark
                queue[nq] = u - l * P
                nq += 1
            u = st.hnext[u]
    first = -1
    key = 0
    for k in range(npend[dmin]):
        c = pend[dmin, k]
        if c // P == l and tree[l, c - l * P] == mark:
            first = c - l * P
            key = dmin * pend.shape[1] + k
            break
    while sg.member[l, first] != call:   # the member the walk from `first` meets
        first = _waiter(inpend, sg.want_ptr, sg.want, pend, npend, l, st.cur[l, first], S, P, E)
    return first, key, clen


@kernel(inline=True)
def _insert_cycle(st, sg, l, first, key, clen, S, P):
    """Add the cycle from member `first` (layer l) to sg.cyc_*, kept sorted by key."""
    cyc_buf, cyc_start, cyc_len, cyc_key = sg.cyc_buf, sg.cyc_start, sg.cyc_len, sg.cyc_key
    E = st.hc.shape[1]
    ncyc = sg.tally[1]
    nbuf = 0                           # the buffer's end (the list is by key, not by buffer)
    for c in range(ncyc):
        nbuf += cyc_len[c]
    c = ncyc
    while c > 0 and cyc_key[c - 1] > key:
        cyc_key[c] = cyc_key[c - 1]
        cyc_start[c] = cyc_start[c - 1]
        cyc_len[c] = cyc_len[c - 1]
        c -= 1
    cyc_key[c] = key
    cyc_start[c] = nbuf
    cyc_len[c] = clen
    node = first
    for t in range(clen):
        cyc_buf[nbuf + t] = l * P + node
        node = _waiter(st.inpend, sg.want_ptr, sg.want, st.pend, st.npend, l, st.cur[l, node], S, P, E)
    sg.tally[1] = ncyc + 1


@kernel
def deadlocks(st, sg, done, nd, S, P, start_N2, nstart):
    """List for `stage` the deadlocked cycles now, after the round's copies done[:nd]: exactly
    the ones `_find_cycles` would list (every cycle of the round, whose graph the round's copies
    do not change) and `stage` would break, in its order and from the same member, without its
    pass over every pending slot. A cycle is a deadlock now if it was one at the round's start
    (start_N2[:nstart]: (layer, expert held) of one member of each, from the chain order) or
    one of its members holds an expert a row of done overwrites, now with < 2 complete
    replicas: only those are walked. Returns how many (0: `stage` has nothing to break)."""
    sg.tally[1] = 0
    sg.tally[3] += 1
    pairs = np.empty((nd + nstart, 2), dtype=np.int64)
    pairs[:nstart] = start_N2[:nstart]
    n = nstart
    for i in range(nd):
        o = st.cur[done[i, 0], done[i, 1]]
        if o >= 0 and st.hc[done[i, 0], o] < 2:
            pairs[n, 0] = done[i, 0]
            pairs[n, 1] = o
            n += 1
    _list_deadlocks(st, sg, pairs, n, S, P, -1)
    return sg.tally[1]


@kernel
def more_deadlocks(st, sg, l, o, S, P, c):
    """`stage` staged into a slot of expert o of layer l, which has < 2 complete replicas now,
    while breaking listed cycle c: list the cycles that became deadlocks through it and come
    after c (`_find_cycles`' full list would reach them later in the same loop)."""
    pairs = np.empty((1, 2), dtype=np.int64)
    pairs[0, 0] = l
    pairs[0, 1] = o
    _list_deadlocks(st, sg, pairs, 1, S, P, c)


@kernel(inline=True)
def _find_cycles(st, sg, P):
    """Walk the "waits for" links from every pending slot; returns the cycles found as
    (count, sg.cyc_buf of codes l * P + p, sg.cyc_start, sg.cyc_len)."""
    pend, npend, G = st.pend, st.npend, st.npend.size
    E = sg.wf.shape[1]
    # Flat views, by code l * P + p and l * E + e (a walk stays in one layer): the passes visit
    # every pending slot. Marks carry the call's number (sg.tally[2]), so nothing is reset.
    wf, wfs, state = sg.wf.reshape(-1), sg.wfs.reshape(-1), sg.state.reshape(-1)
    tgt, cur = st.tgt.reshape(-1), st.cur.reshape(-1)
    sg.tally[2] += 1
    call = sg.tally[2]
    on_path = 2 * call                          # state: below on_path unvisited, on_path + 1 walked
    for d in range(G):
        for k in range(npend[d]):
            code = pend[d, k]
            le = code // P * E + tgt[code]
            if wfs[le] != call:
                wfs[le] = call
                wf[le] = code
    ncyc = 0
    nbuf = 0
    for d in range(G):
        for k in range(npend[d]):
            node = pend[d, k]
            if state[node] >= on_path:
                continue
            lE = node // P * E
            n = 0
            while node >= 0 and state[node] < on_path:
                state[node] = on_path
                sg.path[n] = node
                n += 1
                o = cur[node]
                node = wf[lE + o] if o >= 0 and wfs[lE + o] == call else -1
            if node >= 0 and state[node] == on_path:
                j = 0
                while sg.path[j] != node:
                    j += 1
                sg.cyc_start[ncyc] = nbuf
                sg.cyc_len[ncyc] = n - j
                for t in range(j, n):
                    sg.cyc_buf[nbuf] = sg.path[t]
                    nbuf += 1
                ncyc += 1
            for t in range(n):
                state[sg.path[t]] = on_path + 1
    return ncyc


