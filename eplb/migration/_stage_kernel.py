"""Compiled cycle breaking of the migration schedule (numba): staging copies.

Legend: L = MoE layers, E = logical experts, G = ranks, S = slots per rank, P = G x S slots.

When no pending slot of a round may be written (each holds the only complete replica of its
expert), the "waits for" links between pending slots form cycles; `stage` breaks each with
one copy into a spare slot. `st` is the schedule's state (`_schedule_kernel._Slots`), `sg`
this module's scratch (`_Staging`), `done` the round's transfer rows.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

_Staging = namedtuple("_Staging", [
    "wf",           # first pending slot waiting for (l, e), -1: none
    "state",        # cycle walk: 1 on the path, 2 done
    "path", "cyc_buf", "cyc_start", "cyc_len", "send_busy", "recv_busy",
])


@njit(cache=True, nogil=True, inline="always")
def new_staging(L, P, E, G):
    """Scratch of `stage` for L layers of P slots, E experts and G ranks."""
    return _Staging(np.full((L, E), -1, dtype=np.int64), np.zeros((L, P), dtype=np.int8), np.empty(P, dtype=np.int64),
                    np.empty(L * P, dtype=np.int64), np.empty(L * P, dtype=np.int64), np.empty(L * P, dtype=np.int64),
                    np.zeros(G, dtype=np.bool_), np.zeros(G, dtype=np.bool_))


@njit(cache=True, nogil=True, inline="always")
def _find_cycles(st, sg, P):
    """Walk the "waits for" links from every pending slot; returns the cycles found as
    (count, sg.cyc_buf of codes l * P + p, sg.cyc_start, sg.cyc_len)."""
    pend, npend, G = st.pend, st.npend, st.npend.size
    for d in range(G):
        for k in range(npend[d]):
            l = pend[d, k] // P
            q = pend[d, k] % P
            if sg.wf[l, st.tgt[l, q]] < 0:
                sg.wf[l, st.tgt[l, q]] = q
    ncyc = 0
    nbuf = 0
    for d in range(G):
        for k in range(npend[d]):
            l = pend[d, k] // P
            n = 0
            node = pend[d, k] % P
            while node >= 0 and sg.state[l, node] == 0:
                sg.state[l, node] = 1
                sg.path[n] = node
                n += 1
                o = st.cur[l, node]
                node = sg.wf[l, o] if o >= 0 else -1
            if node >= 0 and sg.state[l, node] == 1:
                j = 0
                while sg.path[j] != node:
                    j += 1
                sg.cyc_start[ncyc] = nbuf
                sg.cyc_len[ncyc] = n - j
                for t in range(j, n):
                    sg.cyc_buf[nbuf] = l * P + sg.path[t]
                    nbuf += 1
                ncyc += 1
            for t in range(n):
                sg.state[l, sg.path[t]] = 2
    for d in range(G):                          # every walked slot is pending: reset them
        for k in range(npend[d]):
            l = pend[d, k] // P
            q = pend[d, k] % P
            sg.state[l, q] = 0
            sg.wf[l, st.tgt[l, q]] = -1
    return ncyc


@njit(cache=True, nogil=True)
def stage(st, sg, done, S, P):
    """Break every cycle of blocked slots at once, one staging copy per cycle; returns the
    copies written to done (0: no spare slot anywhere).

    Slot p is blocked when it holds the last complete replica of its expert o; it waits for
    the first pending slot whose target is o. Following these waits from any pending slot
    ends in a cycle or at a slot nobody waits for. Per cycle, one member's expert is copied
    into a spare slot (final, and its expert has another complete replica), on the member's
    rank if possible (no link), else over links still free in this round. Only when no final
    slot is spare: a pending one that is empty or holds a duplicate and stages nothing yet
    (with as many slots as experts, the slots of experts lost with failed ranks are the only
    room, and their reloads wait for the end; see `schedule`).
    """
    cur, tgt, hc = st.cur, st.tgt, st.hc
    ncyc = _find_cycles(st, sg, P)
    sg.send_busy[:] = False
    sg.recv_busy[:] = False
    nd = 0
    for c in range(ncyc):
        l = sg.cyc_buf[sg.cyc_start[c]] // P
        bp = -1
        bs = -1
        for final in (True, False):
            for t in range(sg.cyc_len[c]):
                p = sg.cyc_buf[sg.cyc_start[c] + t] % P
                for s in range(P):
                    x = cur[l, s]
                    if st.writing[l, s]:
                        continue
                    if final:
                        if x != tgt[l, s] or x < 0 or hc[l, x] < 2:
                            continue
                    elif x == tgt[l, s] or (x >= 0 and hc[l, x] < 2) or st.staged_blk[l, s] >= 0:
                        continue
                    if s // S == p // S:
                        bp = p
                        bs = s
                        break
                    if bp < 0 and not sg.send_busy[p // S] and not sg.recv_busy[s // S]:
                        bp = p
                        bs = s
                if bp >= 0 and bs // S == bp // S:
                    break
            if bp >= 0:
                break
        if bp < 0:
            continue
        if bs // S != bp // S:
            sg.send_busy[bp // S] = True
            sg.recv_busy[bs // S] = True
        st.writing[l, bs] = True
        if cur[l, bs] >= 0:
            hc[l, cur[l, bs]] -= 1
        done[nd, 0] = l
        done[nd, 1] = bs
        done[nd, 2] = cur[l, bp]
        done[nd, 3] = bp // S
        done[nd, 4] = bp
        done[nd, 5] = bs // S
        done[nd, 6] = 1
        nd += 1
    return nd
