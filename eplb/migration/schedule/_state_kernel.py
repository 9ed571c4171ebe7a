"""The migration schedule's state and its bookkeeping, kernels of `_rounds_kernel`.

Legend: L = MoE layers, E = logical experts, G = ranks, S = slots per rank, P = G x S slots,
K = candidates per destination rank and round, M = transfers, R = rounds.

The state lives in namedtuples:
- `_Slots`, the schedule's state: cur_LP (slot contents), hc_LE (each expert's *complete*
  replicas: slots that hold it and are not being written this round), the round's flags
  writing_LP, sourcing_LP, inflight_LE, and pend_GK, each rank's pending slots (code
  l * P + p) in the reference's order;
- `_Round`, one round's network candidates and its transfers so far (done rows);
- `_Work`, the per-rank and per-slot arrays the round's steps share.
`_new_state` builds it, `_queue_chunk` queues a chunk's slots, and after a round `_apply_round`
writes its rows, `_stage_rows` marks its stagings and `_requeue` puts the slots still pending
back in their queues.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from eplb.core.jit import kernel
from eplb.migration.schedule._senders_kernel import touch, unlink

_Slots = namedtuple("_Slots", [
    "cur", "tgt", "hc", "writing", "sourcing", "inflight", "inpend",
    "staged_blk",   # staging slot -> the blocked slot it stages for (-1: none)
    "staged_exp",   # ... and the expert it holds for it
    "pend", "npend",
    "ndist",        # experts held per layer, at round start + reloads (tight layers)
    "npl",          # pending slots per layer at round start (tight layers)
    "hsum",         # sum of the slots holding each expert (cur): its holder where it has one
    "ncur",         # slots holding each expert (cur, written or not)
    "hhead", "hnext", "hprev",   # slots holding each expert (cur): list heads [L * E], links [L * P]
    "mayloc",       # [L, P] may another slot of its rank ever hold its target (a local source)?
    "nstaged",      # [1] slots with a staging mark (staged_blk >= 0)
    # The chain order's per-slot links, kept from round to round (`_senders_kernel.chain_order`):
    "loc",          # [L, P] a pending slot has a local source (its rank holds its target)
    "dirty",        # [L * E] an expert whose holders or their staging marks changed since
    "dlist",        # ... the chain order last ran, listed here; dn[0] of them,
    "dn",           # [2]: dn[1] = 1: every pending slot's links are recomputed (a new chunk)
])


_Round = namedtuple("_Round", [
    "cand", "cand_e",     # [G, K] each rank's candidate slots (code l * P + p) and their targets
    "ncand", "adj",       # [G] candidates per rank; [G, 2G] a rank's candidates have a source there
    # Candidate i of rank d: for cstart[d, i] <= j < cstart[d, i + 1], a column cols[d, j] (ranks
    # 0..G-1, checkpoint G + d) with a source and the lowest source slot there srcs[d, j] (-1: checkpoint).
    "cols", "srcs", "cstart",
    "done",               # the round's transfers: l, p, e, src rank, src, d, staging
    "pref", "npref",      # [G, 2G] each rank's columns in the order its link matching tries them
])


_Work = namedtuple("_Work", [
    "rin", "rout",        # [G] network copies each rank still receives / must send alone (chain_order)
    "sent",               # [G] network copies each rank has sent
    "fsrc",               # [L, P] the forced (or, relay mode, planned) source rank of a pending copy
    "depth",              # [L, P] chain depth of a pending slot (`_senders_kernel.chain_order`)
    "crit", "late",       # [G] send-critical ranks (`take_links`), receive-critical ones
    "hold_LP",            # [L, P] the slot a pending slot keeps its expert for (-1: none)
    "key", "nh", "hr",    # scratch of the chain order and the forced sources
    "start",              # [L * P, 2] (layer, expert) in a deadlock at a round's start
])


@kernel
def _grow(a, n):
    """a with room for at least n rows (doubling), rows kept."""
    if n <= a.shape[0]:
        return a
    b = np.empty((max(n, 2 * a.shape[0]),) + a.shape[1:], dtype=a.dtype)
    b[:a.shape[0]] = a
    return b


@kernel
def pend_layer(pend, npend, P):
    """Layer of the first pending slot (for the error message), or -1."""
    for d in range(npend.size):
        if npend[d]:
            return pend[d, 0] // P
    return -1


@kernel(inline=True)
def _hold(head, nxt, prv, he, code):
    """Put slot code (l * P + p) at the front of the holders of he (l * E + e)."""
    h = head[he]
    nxt[code] = h
    prv[code] = -1
    if h >= 0:
        prv[h] = code
    head[he] = code


@kernel(inline=True)
def _may_local(old_LP, new_LP, S):
    """[L, P]: may another slot of p's rank hold p's target while p is pending? A slot only
    ever holds its old expert, its target or a staged expert (`_stage_rows` adds those, and
    sets a slot staged out of its final state, pending from then on), so where no other slot
    of the rank starts with or ends with p's target, p never has a local source: the scan and
    the chain order skip its holder walks (their busiest loops)."""
    L, P = new_LP.shape
    out = np.zeros((L, P), dtype=np.bool_)
    for l in range(L):
        for p in range(P):
            if old_LP[l, p] != new_LP[l, p]:
                out[l, p] = _local_ahead(old_LP, new_LP, l, p, S)
    return out


@kernel(inline=True)
def _local_ahead(cur_LP, new_LP, l, p, S):
    """Does another slot of p's rank hold p's target now (cur_LP) or at the end (new_LP)?"""
    e = new_LP[l, p]
    g0 = p - p % S
    for q in range(g0, g0 + S):
        if q != p and (cur_LP[l, q] == e or new_LP[l, q] == e):
            return True
    return False


@kernel(inline=True)
def _new_state(old_LP, new_LP, G, E):
    """The _Slots of a schedule from old_LP to new_LP: nothing pending yet."""
    L, P = new_LP.shape
    S = P // G
    # The [L, P] and [L, E] state is int32 (slot codes l * P + p, expert ids, counts: all below
    # L x P, which `eplb.migration.schedule` checks is below 2^31): the kernel's time goes to
    # visiting pending slots across these arrays, and half their width is 0.88-0.94x its time
    # (the gain largest at 128 GPUs, whose state outgrows the L2 cache; the rows are the same).
    hc = np.zeros((L, E), dtype=np.int32)
    hsum = np.zeros((L, E), dtype=np.int32)
    hhead = np.full(L * E, -1, dtype=np.int32)
    hnext = np.full(L * P, -1, dtype=np.int32)
    hprev = np.full(L * P, -1, dtype=np.int32)
    # Each expert's holders, each slot put in front (`_hold`, written out: numba reference-counts
    # an inlined helper's array arguments at every call; measured at 32 GPUs, writing it out
    # saves 33k reference-count pairs, about 5% of the kernel's time).
    for l in range(L):
        for p in range(P):
            o = old_LP[l, p]
            if o >= 0:
                hc[l, o] += 1
                hsum[l, o] += p
                h = hhead[l * E + o]
                hnext[l * P + p] = h
                if h >= 0:
                    hprev[h] = l * P + p
                hhead[l * E + o] = l * P + p
    return _Slots(
        old_LP.astype(np.int32), new_LP.astype(np.int32), hc, np.zeros((L, P), dtype=np.bool_),
        np.zeros((L, P), dtype=np.bool_), np.zeros((L, E), dtype=np.bool_), np.zeros((L, P), dtype=np.bool_),
        np.full((L, P), -1, dtype=np.int32), np.full((L, P), -1, dtype=np.int32),
        np.empty((G, L * S), dtype=np.int32), np.zeros(G, dtype=np.int64),
        np.zeros(L, dtype=np.int64), np.zeros(L, dtype=np.int64), hsum, hc.copy(), hhead, hnext, hprev,
        _may_local(old_LP, new_LP, S), np.zeros(1, dtype=np.int64),
        np.zeros((L, P), dtype=np.bool_), np.zeros(L * E, dtype=np.bool_), np.empty(L * E, dtype=np.int32),
        np.zeros(2, dtype=np.int64))


@kernel(inline=True)
def _queue_chunk(st, c0, c1, S, P, depth):
    """Queue the slots of layers c0..c1-1 that change on their ranks (their chain depths cleared);
    returns how many."""
    st.npend[:] = 0
    for l in range(c0, c1):
        for p in range(P):
            if st.cur[l, p] != st.tgt[l, p]:
                g = p // S
                st.pend[g, st.npend[g]] = l * P + p
                st.npend[g] += 1
                st.inpend[l, p] = True
                depth[l, p] = -1
    st.dn[1] = 1
    return st.npend.sum()


@kernel(inline=True)
def _count_room(st, c0, c1, E, P):
    """Round-start counts of a layer's spare room (tight layers): experts held, pending slots."""
    for l in range(c0, c1):
        st.npl[l] = 0
        st.ndist[l] = 0
        for e in range(E):
            if st.hc[l, e] > 0:
                st.ndist[l] += 1
    for d in range(st.npend.size):
        for k in range(st.npend[d]):
            st.npl[st.pend[d, k] // P] += 1


@kernel(inline=True)
def _release_holds(hold_LP, pend, npend, P):
    """Nothing moved this round: the slots held back for an exchange (`_links_kernel.held_back`)
    give way. Returns whether any did."""
    any_held = False
    for d in range(npend.size):
        for k in range(npend[d]):
            c = pend[d, k]
            if hold_LP[c // P, c % P] >= 0:
                hold_LP[c // P, c % P] = -1
                any_held = True
    return any_held


@kernel(inline=True)
def _apply_round(st, done, nd, out, M, R):
    """Write the nd copies of round R into the slots and as rows M.. of out (grown as needed);
    returns (out, new M)."""
    out = _grow(out, M + nd)
    E = st.hc.shape[1]
    P = st.cur.shape[1]
    for i in range(nd):
        l = done[i, 0]
        p = done[i, 1]
        e = done[i, 2]
        o = st.cur[l, p]
        if o >= 0:
            st.hsum[l, o] -= p
            st.ncur[l, o] -= 1
            unlink(st.hhead, st.hnext, st.hprev, l * E + o, l * P + p)
            touch(st, l * E + o)
        touch(st, l * E + e)
        _hold(st.hhead, st.hnext, st.hprev, l * E + e, l * P + p)
        st.cur[l, p] = e
        st.hc[l, e] += 1
        st.hsum[l, e] += p
        st.ncur[l, e] += 1
        st.writing[l, p] = False
        if done[i, 4] >= 0:
            st.sourcing[l, done[i, 4]] = False
        st.inflight[l, e] = False
        out[M, 0] = R
        out[M, 1] = l
        out[M, 2] = e
        out[M, 3] = done[i, 3]
        out[M, 4] = done[i, 4]
        out[M, 5] = done[i, 5]
        out[M, 6] = p
        out[M, 7] = done[i, 6]
        M += 1
    return out, M


@kernel(inline=True)
def _requeue(st, done, nd, S, P, depth):
    """Drop the slots that reached their target from the queues; a staging copy makes its slot
    pending again (it must get its own expert back). Clears the chain depths of the slots still
    pending for the next chain order. Returns the slots still pending."""
    cur, tgt, inpend = st.cur.reshape(-1), st.tgt.reshape(-1), st.inpend.reshape(-1)
    dep = depth.reshape(-1)
    for d in range(st.npend.size):
        n = 0
        for k in range(st.npend[d]):
            code = st.pend[d, k]
            if cur[code] != tgt[code]:
                st.pend[d, n] = code
                n += 1
                dep[code] = -1
            else:
                inpend[code] = False
        st.npend[d] = n
    for i in range(nd):
        l = done[i, 0]
        p = done[i, 1]
        if st.cur[l, p] != st.tgt[l, p] and not st.inpend[l, p]:
            g = p // S
            st.pend[g, st.npend[g]] = l * P + p
            st.npend[g] += 1
            st.inpend[l, p] = True
            dep[l * P + p] = -1
            touch(st, l * st.hc.shape[1] + st.tgt[l, p])
    return st.npend.sum()


@kernel(inline=True)
def _stage_rows(st, done, i, S):
    """Row i of the round is a staging copy: mark its slot (pending from now on, see
    `_may_local`), and let the slots of its rank whose target it stages find a local source there."""
    l = done[i, 0]
    s = done[i, 1]
    x = done[i, 2]
    E = st.hc.shape[1]
    if not st.mayloc[l, s]:
        st.mayloc[l, s] = _local_ahead(st.cur, st.tgt, l, s, S)
    touch(st, l * E + st.tgt[l, s])
    touch(st, l * E + x)
    if st.staged_blk[l, s] < 0:
        st.nstaged[0] += 1
    st.staged_blk[l, s] = done[i, 4]
    st.staged_exp[l, s] = x
    g0 = done[i, 5] * S
    for q in range(g0, g0 + S):
        if q != s and st.tgt[l, q] == x:
            st.mayloc[l, q] = True
