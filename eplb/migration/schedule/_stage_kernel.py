"""Compiled cycle breaking of the migration schedule (numba): staging copies.

Legend: L = MoE layers, E = logical experts, G = ranks, S = slots per rank, P = G x S slots.

When no pending slot of a round may be written (each holds the only complete replica of its
expert), the "waits for" links between pending slots form cycles (`_cycles_kernel` finds
them); `stage` breaks each with one copy into a spare slot. `st` is the schedule's state
(`_state_kernel._Slots`), `sg` the cycles' scratch (`_cycles_kernel._Staging`), `done` the
round's transfer rows. The schedule calls `stage` only where `is_deadlock` or `deadlocks`
found a deadlock (or nothing else moved).
"""

from __future__ import annotations

import numpy as np

from eplb.core.jit import kernel
from eplb.migration.schedule._cycles_kernel import _find_cycles, more_deadlocks

# Where `stage` takes its cycles from (its `cycles` argument):
FIND = 0      # `_find_cycles`, every cycle
KEEP = 1      # the list of this round's earlier call
LISTED = 2    # the deadlocks `_cycles_kernel.deadlocks` listed, and those its stagings add (modes 0, 1)

# The spares `_spare` tells apart:
PENDING = 1   # a pending slot (it changes anyway)
FINAL = 2     # a slot in its final state (restored after the staging)


@kernel(inline=True)
def _spare(x, target, busy, copies, staged):
    """Can a slot take a staged expert this round? x: the expert it holds, target: its target,
    busy: written or sourcing this round, copies: complete replicas of x, staged: it has a
    staging mark. PENDING: it changes anyway (nothing to restore); FINAL: it is in its final
    state (restored afterwards); either way it is not busy this round and its own expert keeps
    another complete replica; else 0. (Scalars, not arrays: numba reference-counts an inlined
    helper's array arguments at every call, which here cost more than the loops' own work.)"""
    if busy or not (x < 0 or copies >= 2):
        return 0
    if x != target:
        return 0 if staged else PENDING
    return FINAL if x >= 0 else 0


@kernel(inline=True)
def _left_to_critical(st, crit, l, s, x, S, P):
    """Would overwriting slot s (layer l) leave every other complete replica of its expert x on
    send-critical ranks (crit)? They would then have to send every copy of x still to be made,
    a final slot's restore included: sends their rounds cannot spare."""
    E = st.hc.shape[1]
    h = st.hhead[l * E + x]
    while h >= 0:
        q = h - l * P
        if q != s and not st.writing[l, q] and not crit[q // S]:
            return False
        h = st.hnext[h]
    return True


@kernel
def stage(st, sg, done, S, P, nd, mode, rin, depth, cycles, crit, ncrit):
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
    (rin, see `_senders_kernel.chain_order`), which bound the rounds; a final slot's restore is
    counted into rin at once (several cycles of a round may pick one rank), and a final slot on
    a rank whose receives already bound the rounds (rin = max rin) is not taken while other
    copies move (modes 0, 1): its cycle waits for a spare that costs no round (at a round's
    start every deadlock of a migration made of exchanges appears at once, and restores piled
    onto the busiest receivers cost up to 8% more rounds on decision migrations); nor, then,
    a spare whose expert it would leave on send-critical ranks alone (crit, ncrit of them:
    `_left_to_critical`). A pending spare's own copy waits while it holds the staged expert,
    and so does the chain of slots waiting on it (depth [L, P]: the chain lengths of
    `_senders_kernel.chain_order`), so it is free only when that chain plus the cycle fits in
    the longest wait (max rin), else it weighs their sum. Links
    already used this round are respected. mode 0: deadlocks only, through a pending slot on
    the member's rank only (free: run before the round's other copies take those slots);
    mode 1: deadlocks, any spare; mode 2 (nothing else moved this round): every cycle, any
    spare (with as many slots as experts, the slots of experts lost with failed ranks are
    the only room, and their reloads wait for the end; see `schedule`). cycles: FIND, KEEP or
    LISTED (modes 0 and 1: a list of deadlocks only), see above.
    """
    if cycles == FIND:
        sg.tally[1] = _find_cycles(st, sg, P)
    G = st.npend.size
    for g in range(G):
        sg.send_busy[g] = False
        sg.recv_busy[g] = False
    for i in range(nd):                     # links the round's copies use already
        if done[i, 3] != done[i, 5]:
            if done[i, 4] >= 0:
                sg.send_busy[done[i, 3]] = True
            sg.recv_busy[done[i, 5]] = True
    spare_crit = ncrit > 0 and mode < 2    # while other copies move, spare the send-critical ranks
    rmax = 0
    nfree = 0                               # ranks that can still receive over a link
    for g in range(G):
        rmax = max(rmax, rin[g])
        nfree += not sg.recv_busy[g]
    c = -1
    while c + 1 < sg.tally[1]:              # (LISTED: the list grows as stagings make deadlocks)
        c += 1
        l = sg.cyc_buf[sg.cyc_start[c]] // P
        if mode < 2 and not _stuck(st, sg, c, l, P):
            continue
        bp, bs = _best_spare(st, sg, c, l, S, P, mode, rin, depth, rmax, nfree, spare_crit, crit)
        if bp < 0:
            continue
        if st.cur[l, bs] == st.tgt[l, bs]:
            rin[bs // S] += 1             # a final slot's restore: one more copy into its rank
        if bs // S != bp // S:
            sg.send_busy[bp // S] = True
            sg.recv_busy[bs // S] = True
            nfree -= 1
        nd = _staging_row(st, sg, done, nd, c, l, bp, bs, S, P, cycles)
    return nd


@kernel(inline=True)
def _stuck(st, sg, c, l, P):
    """While other copies move, a cycle of waits is a deadlock only if every member holds the last
    complete replica of its expert; otherwise it unwinds by itself."""
    for t in range(sg.cyc_len[c]):
        o = st.cur[l, sg.cyc_buf[sg.cyc_start[c] + t] % P]
        if o < 0 or st.hc[l, o] >= 2:
            return False
    return True


@kernel(inline=True)
def _best_spare(st, sg, c, l, S, P, mode, rin, depth, rmax, nfree, spare_crit, crit):
    """(member slot, spare slot) of cycle c to stage through, the lightest by `stage`'s weights,
    or (-1, -1): the member's own rank first, then (modes 1, 2) the other ranks' free receivers."""
    cur, tgt, hc, writing, sourcing, staged_blk = st.cur, st.tgt, st.hc, st.writing, st.sourcing, st.staged_blk
    G = st.npend.size
    bp = -1
    bs = -1
    best = np.inf
    clen = sg.cyc_len[c]
    for t in range(sg.cyc_len[c]):
        p = sg.cyc_buf[sg.cyc_start[c] + t] % P
        if writing[l, p] or sourcing[l, p] or cur[l, p] < 0:
            continue
        r0 = p // S
        for s in range(r0 * S, r0 * S + S):
            x = cur[l, s]
            if s == p or x == cur[l, p]:
                continue
            kind = _spare(x, tgt[l, s], writing[l, s] or sourcing[l, s], hc[l, x] if x >= 0 else 0,
                          staged_blk[l, s] >= 0)
            if kind == PENDING:
                # s's own copy waits for the cycle: free unless that makes its chain the longest wait.
                w = depth[l, s] + clen
                if w <= rmax:
                    w = -1.0 / (1.0 + depth[l, s])
                elif mode == 0:
                    continue
            elif mode > 0 and kind == FINAL and (mode == 2 or rin[r0] < rmax):
                w = rin[r0] + 1.0
            else:
                continue
            if w < best and not (spare_crit and x >= 0 and _left_to_critical(st, crit, l, s, x, S, P)):
                best = w
                bp = p
                bs = s
        if best < 0.0 or mode == 0 or sg.send_busy[r0] or nfree == 0:
            continue
        for rc in range(G):
            # A slot of rank rc weighs rin[rc] + 1 at least: a rank that cannot beat best is skipped.
            if rc == r0 or sg.recv_busy[rc] or rin[rc] + 1.0 >= best:
                continue
            for s in range(rc * S, rc * S + S):
                x = cur[l, s]
                if x == cur[l, p]:
                    continue
                kind = _spare(x, tgt[l, s], writing[l, s] or sourcing[l, s], hc[l, x] if x >= 0 else 0,
                              staged_blk[l, s] >= 0)
                if kind == PENDING:
                    w = max(rin[rc] + 1.0, depth[l, s] + clen)
                elif kind == FINAL and (mode == 2 or rin[rc] < rmax):
                    w = 2.0 * (rin[rc] + 1.0)
                else:
                    continue
                if w < best and not (spare_crit and x >= 0 and _left_to_critical(st, crit, l, s, x, S, P)):
                    best = w
                    bp = p
                    bs = s
    return bp, bs


@kernel(inline=True)
def _staging_row(st, sg, done, nd, c, l, bp, bs, S, P, cycles):
    """Stage cycle c's member bp through spare bs: row nd of done; returns nd + 1."""
    cur = st.cur
    st.writing[l, bs] = True
    st.sourcing[l, bp] = True
    if cur[l, bs] >= 0:
        st.hc[l, cur[l, bs]] -= 1
        if cycles == LISTED and st.hc[l, cur[l, bs]] < 2:
            more_deadlocks(st, sg, l, cur[l, bs], S, P, c)
    done[nd, 0] = l
    done[nd, 1] = bs
    done[nd, 2] = cur[l, bp]
    done[nd, 3] = bp // S
    done[nd, 4] = bp
    done[nd, 5] = bs // S
    done[nd, 6] = 1
    return nd + 1
