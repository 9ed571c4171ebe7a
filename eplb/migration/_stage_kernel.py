"""Compiled cycle breaking of the migration schedule (numba): staging copies.

Legend: L = MoE layers, E = logical experts, G = ranks, S = slots per rank, P = G x S slots.

When no pending slot of a round may be written (each holds the only complete replica of its
expert), the "waits for" links between pending slots form cycles; `stage` breaks each with
one copy into a spare slot. `st` is the schedule's state (`_schedule_kernel._Slots`), `sg`
this module's scratch (`_Staging`), `done` the round's transfer rows. Finding the cycles takes
a pass over every pending slot, so the schedule calls `stage` only where `is_deadlock` or
`may_deadlock` says it can find a deadlock (or nothing else moved).
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

_Staging = namedtuple("_Staging", [
    "wf",           # first pending slot waiting for (l, e) (code l * P + p), valid where
    "wfs",          # ... wfs [L, E] is the walk's call number (sg.tally[2])
    "state",        # cycle walk: 2 x call on the path, 2 x call + 1 done, lower: not seen
    "path", "cyc_buf", "cyc_start", "cyc_len", "send_busy", "recv_busy",
    "want_ptr", "want",   # slots by target: want[want_ptr[l * E + e]:want_ptr[l * E + e + 1]], by slot
    "seen",         # may_deadlock's walks: the walk that saw a slot last
    "tally",        # [0] may_deadlock's walks so far, [1] the cycles `_find_cycles` found last,
                    # [2] its calls so far
    "path_LP",      # [L, P] scratch of the schedule's chain order
])


@njit(cache=True, nogil=True, inline="always")
def new_staging(new_LP, E, G):
    """Scratch of `stage` for the target new_LP [L, P] of E experts over G ranks."""
    L, P = new_LP.shape
    want_ptr = np.zeros(L * E + 1, dtype=np.int64)
    for l in range(L):
        for p in range(P):
            want_ptr[l * E + new_LP[l, p] + 1] += 1
    want_ptr = np.cumsum(want_ptr)
    fill = want_ptr[:-1].copy()
    want = np.empty(L * P, dtype=np.int64)
    for l in range(L):
        for p in range(P):
            want[fill[l * E + new_LP[l, p]]] = p
            fill[l * E + new_LP[l, p]] += 1
    return _Staging(np.full((L, E), -1, dtype=np.int64), np.zeros((L, E), dtype=np.int64),
                    np.zeros((L, P), dtype=np.int64), np.empty(P, dtype=np.int64),
                    np.empty(L * P, dtype=np.int64), np.empty(L * P, dtype=np.int64), np.empty(L * P, dtype=np.int64),
                    np.zeros(G, dtype=np.bool_), np.zeros(G, dtype=np.bool_), want_ptr, want,
                    np.full((L, P), -1, dtype=np.int64), np.zeros(3, dtype=np.int64),
                    np.empty((L, P), dtype=np.int64))


@njit(cache=True, nogil=True)
def _first_waiting(st, sg, l, o, S, P):
    """The pending slot that waits for expert o of layer l in `_find_cycles` (the first in
    queue order whose target is o), or -1."""
    E = sg.wf.shape[1]
    best = -1
    for i in range(sg.want_ptr[l * E + o], sg.want_ptr[l * E + o + 1]):
        q = sg.want[i]
        if not st.inpend[l, q]:
            continue
        if best < 0:
            best = q
        elif q // S == best // S:          # two on one rank: the earlier in its queue
            d = q // S
            for k in range(st.npend[d]):
                c = st.pend[d, k]
                if c == l * P + best:
                    break
                if c == l * P + q:
                    best = q
                    break
        else:
            break                          # slots by index: later ranks come later
    return best


@njit(cache=True, nogil=True)
def is_deadlock(st, sg, code, S, P):
    """Is the cycle of chain links through pending slot code = l * P + q (sg.path_LP: the slot
    each pending slot waits on, as such codes, see `_chain_kernel.chain_order`) a
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


@njit(cache=True, nogil=True)
def may_deadlock(st, sg, done, nd, S, P):
    """Could `stage` (mode 1) find a deadlock after the round's copies done[:nd], when no
    chain closed into a cycle at the round's start? Such a cycle's members all hold a last
    complete replica, and one of them became last because done[:nd] writes a slot of the
    same expert; so walk the waits from every pending slot holding an expert a row of done
    overwrites and has < 2 complete replicas now, and see whether one comes back to its start."""
    cur, hc, inpend, want_ptr, want, seen = st.cur, st.hc, st.inpend, sg.want_ptr, sg.want, sg.seen
    E = hc.shape[1]
    for i in range(nd):
        l = done[i, 0]
        p = done[i, 1]
        o = cur[l, p]
        if o < 0 or hc[l, o] >= 2:
            continue
        # The slots holding o at the round's start: p, and where two do, the other one.
        other = st.hsum[l, o] - p if st.ncur[l, o] == 2 else -1
        many = st.ncur[l, o] > 2
        for k in range(P if many else 2):
            m = k if many else (p if k == 0 else other)
            if m < 0 or cur[l, m] != o or not inpend[l, m]:
                continue
            sg.tally[0] += 1
            node = m
            while True:
                x = cur[l, node]
                if x < 0 or hc[l, x] >= 2:
                    break
                nxt = -1                   # _first_waiting, inline: the first pending slot ...
                for t in range(want_ptr[l * E + x], want_ptr[l * E + x + 1]):
                    q = want[t]
                    if nxt < 0:
                        if inpend[l, q]:
                            nxt = q
                    elif q // S != nxt // S:
                        break
                    elif inpend[l, q]:
                        nxt = _first_waiting(st, sg, l, x, S, P)   # ... unless a rank has two
                        break
                if nxt == m:
                    return True
                if nxt < 0 or seen[l, nxt] == sg.tally[0]:
                    break
                seen[l, nxt] = sg.tally[0]
                node = nxt
    return False


@njit(cache=True, nogil=True, inline="always")
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


@njit(cache=True, nogil=True, inline="always")
def _spare(st, l, s, pending):
    """Can slot s of layer l take a staged expert this round? pending: a slot that changes
    anyway (nothing to restore), else one in its final state (restored afterwards); either
    way it is not busy this round and its own expert keeps another complete replica."""
    x = st.cur[l, s]
    if st.writing[l, s] or st.sourcing[l, s]:
        return False
    if pending:
        return x != st.tgt[l, s] and (x < 0 or st.hc[l, x] >= 2) and st.staged_blk[l, s] < 0
    return x == st.tgt[l, s] and x >= 0 and st.hc[l, x] >= 2


@njit(cache=True, nogil=True)
def stage(st, sg, done, S, P, nd, mode, rin, depth, again):
    """Break cycles of blocked slots, one staging copy per cycle, as rows nd.. of done; returns
    the new row count (nd: no cycle could be broken).

    Slot p is blocked when it holds the last complete replica of its expert o; it waits for
    the first pending slot whose target is o. Following these waits from any pending slot
    ends in a cycle or at a slot nobody waits for; a cycle whose every member is blocked is
    a deadlock. Per such cycle, one member's expert is copied into a spare slot (`_spare`),
    the one that adds least to a busy rank's receiving: a pending slot on the member's own
    rank adds nothing (no link, and it changes anyway); a final slot there adds the copy
    that restores it later; a pending slot on another rank adds that rank's receive now (a
    final one there, two). Each is weighed by the rounds the receiving rank still needs
    (rin, see `_chain_kernel.chain_order`), which bound the rounds. A pending spare's
    own copy waits while it holds the staged expert, and so does the chain of slots waiting
    on it (depth [L, P]: the chain lengths of `_chain_kernel.chain_order`), so it is free only when that
    chain plus the cycle fits in the longest wait (max rin), else it weighs their sum. Links
    already used this round are respected. mode 0: deadlocks only, through a pending slot on
    the member's rank only (free: run before the round's other copies take those slots);
    mode 1: deadlocks, any spare; mode 2 (nothing else moved this round): every cycle, any
    spare (with as many slots as experts, the slots of experts lost with failed ranks are
    the only room, and their reloads wait for the end; see `schedule`).
    """
    cur = st.cur
    if not again:                           # again: the cycles of this round's earlier call
        sg.tally[1] = _find_cycles(st, sg, P)
    ncyc = sg.tally[1]
    G = st.npend.size
    for g in range(G):
        sg.send_busy[g] = False
        sg.recv_busy[g] = False
    for i in range(nd):                     # links the round's copies use already
        if done[i, 3] != done[i, 5]:
            if done[i, 4] >= 0:
                sg.send_busy[done[i, 3]] = True
            sg.recv_busy[done[i, 5]] = True
    rmax = 0
    for g in range(G):
        rmax = max(rmax, rin[g])
    for c in range(ncyc):
        l = sg.cyc_buf[sg.cyc_start[c]] // P
        if mode < 2:
            # While other copies move, a cycle of waits is a deadlock only if every member holds
            # the last complete replica of its expert; otherwise it unwinds by itself.
            stuck = True
            for t in range(sg.cyc_len[c]):
                o = cur[l, sg.cyc_buf[sg.cyc_start[c] + t] % P]
                if o < 0 or st.hc[l, o] >= 2:
                    stuck = False
                    break
            if not stuck:
                continue
        bp = -1
        bs = -1
        best = np.inf
        clen = sg.cyc_len[c]
        for t in range(sg.cyc_len[c]):
            p = sg.cyc_buf[sg.cyc_start[c] + t] % P
            if st.writing[l, p] or st.sourcing[l, p] or cur[l, p] < 0:
                continue
            r0 = p // S
            for s in range(r0 * S, r0 * S + S):
                if s == p or cur[l, s] == cur[l, p]:
                    continue
                if _spare(st, l, s, True):
                    # s's own copy waits for the cycle: free unless that makes its chain the longest wait.
                    w = depth[l, s] + clen
                    if w <= rmax:
                        w = -1.0 / (1.0 + depth[l, s])
                    elif mode == 0:
                        continue
                elif mode > 0 and _spare(st, l, s, False):
                    w = rin[r0] + 1.0
                else:
                    continue
                if w < best:
                    best = w
                    bp = p
                    bs = s
            if best < 0.0 or mode == 0 or sg.send_busy[r0]:
                continue
            for rc in range(G):
                # A slot of rank rc weighs rin[rc] + 1 at least: a rank that cannot beat best is skipped.
                if rc == r0 or sg.recv_busy[rc] or rin[rc] + 1.0 >= best:
                    continue
                for s in range(rc * S, rc * S + S):
                    if cur[l, s] == cur[l, p]:
                        continue
                    if _spare(st, l, s, True):
                        w = max(rin[rc] + 1.0, depth[l, s] + clen)
                    elif _spare(st, l, s, False):
                        w = 2.0 * (rin[rc] + 1.0)
                    else:
                        continue
                    if w < best:
                        best = w
                        bp = p
                        bs = s
        if bp < 0:
            continue
        if bs // S != bp // S:
            sg.send_busy[bp // S] = True
            sg.recv_busy[bs // S] = True
        st.writing[l, bs] = True
        st.sourcing[l, bp] = True
        if cur[l, bs] >= 0:
            st.hc[l, cur[l, bs]] -= 1
        done[nd, 0] = l
        done[nd, 1] = bs
        done[nd, 2] = cur[l, bp]
        done[nd, 3] = bp // S
        done[nd, 4] = bp
        done[nd, 5] = bs // S
        done[nd, 6] = 1
        nd += 1
    return nd
