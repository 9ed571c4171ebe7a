"""Compiled migration schedule (numba): the rounds of `eplb.migration.schedule`.

Legend: L = MoE layers, E = logical experts, G = ranks, S = slots per rank, P = G x S slots,
K = candidates per destination rank and round, M = transfers, R = rounds.

The greedy rounds of the Python reference (tests/oracles/migration_schedule.py, held to the
same replay in the tests, not to equal rounds), on flat arrays instead of dicts and sets;
the kernel alone orders links and sources by chain and send load and weighs staging slots by
the chains behind them (docs/migration-internals.md, "Rounds against the round bound").
Its state and the bookkeeping around a round are `_state_kernel`'s. A round:
`_senders_kernel.chain_order` orders each rank's queue by the chains of waits; `_scan` takes
local copies at once and lists network and checkpoint candidates;
`_links_kernel.take_links` gives the links to a maximum matching of destination ranks to source ranks
(augmenting paths, the ranks with the most copies left tried first: the reference asks
scipy for any maximum matching), so the busiest receivers, which bound the number of rounds,
are the last to wait; each rank tries the sources of its candidates in its queue order (its
longest chain first), each candidate's source ranks by the fewest sends (made, plus those
only they can make), so that free copies do not pile onto a few senders; a slot about to be
overwritten in an exchange whose expert would then have its only sources on a send-critical
rank keeps it, the other side staged first (`_links_kernel._exchange_stage`); when nothing can
move, `_stage_kernel.stage` breaks the cycles (`_cycles_kernel` finds them); `_apply_round`
writes the round. In the relay mode (`schedule_relay`) `_senders_kernel.plan_sources` plans
a levelled source per network copy at each round's start, relays included, and the link
matching follows it. Ties among
replicas on one rank pick the lowest slot index. Releases the GIL: a serving thread keeps
running while a side thread schedules.
"""

from __future__ import annotations

import numpy as np

from eplb.core.jit import kernel
from eplb.migration.schedule._cycles_kernel import deadlocks, new_staging
from eplb.migration.schedule._links_kernel import commit, held_back, take_links
from eplb.migration.schedule._senders_kernel import chain_order, forced_sources, plan_sources, touch
from eplb.migration.schedule._stage_kernel import FIND, KEEP, LISTED, stage
from eplb.migration.schedule._state_kernel import (
    _apply_round,
    _count_room,
    _grow,
    _new_state,
    _queue_chunk,
    _release_holds,
    _requeue,
    _Round,
    _stage_rows,
    _Work,
    pend_layer,
)

STATUS_OK = 0
STATUS_NO_SPARE = -1      # every pending slot is blocked and no spare slot can stage
STATUS_NO_PROGRESS = -2   # the round guard ran out (a bug)
STATUS_STOPPED = -3       # the caller asked it to stop (stop[0] set): the rows so far, unfinished


@kernel(inline=True)
def _kept(st, l, x, E, P):
    """Does a slot in its final state hold expert x of layer l completely? (Then a staging copy of x
    is not needed any more: the slot it staged for may be written without it.)"""
    h = st.hhead[l * E + x]
    while h >= 0:
        if st.tgt[l, h - l * P] == x and not st.writing[l, h - l * P]:
            return True
        h = st.hnext[h]
    return False


@kernel(inline=True)
def _scan(st, rd, S, P, tight, nd, hold_LP, late_G):
    """Local copies are taken at once (no link); network and checkpoint candidates (at most
    K per destination rank) go to rd for the link matching. nd: rows of rd.done taken
    already this round. Returns the copies taken so far."""
    G = st.npend.size
    K = rd.cand.shape[1]
    E = st.hc.shape[1]
    cur, tgt, hc = st.cur, st.tgt, st.hc
    for d in range(G):                     # last round's candidates' links, cleared
        for j in range(rd.cstart[d, rd.ncand[d]]):
            rd.adj[d, rd.cols[d, j]] = False
        rd.ncand[d] = 0
    mayloc, staged_blk = st.mayloc.reshape(-1), st.staged_blk.reshape(-1)
    for d in range(G):
        lo = d * S
        for k in range(st.npend[d]):
            code = st.pend[d, k]
            # With its rank's candidates listed, a slot without a local source and no staging
            # mark to clear has nothing left to do here.
            if rd.ncand[d] >= K and not mayloc[code] and staged_blk[code] < 0:
                continue
            l = code // P
            p = code - l * P
            if st.sourcing[l, p] or st.writing[l, p]:
                continue
            if st.staged_blk[l, p] >= 0:
                if cur[l, st.staged_blk[l, p]] == st.staged_exp[l, p] and not _kept(st, l, st.staged_exp[l, p], E, P):
                    continue               # its blocked slot still needs the copy
                st.staged_blk[l, p] = -1
                st.nstaged[0] -= 1
                touch(st, l * E + cur[l, p])
            o = cur[l, p]
            e = tgt[l, p]
            if o >= 0 and hc[l, o] < 2:
                continue                   # p holds the last complete replica of o
            if hc[l, e] > 0:
                # The lowest complete slot holding e on each rank (a local one first).
                local = -1
                h = st.hhead[l * E + e] if st.mayloc[l, p] else -1
                while h >= 0:
                    s = h - l * P
                    if lo <= s < lo + S and not st.writing[l, s] and (local < 0 or s < local):
                        local = s
                    h = st.hnext[h]
                if local >= 0:
                    if hold_LP[l, p] >= 0 and held_back(hold_LP, cur, tgt, l, p, late_G[d]):
                        continue
                    commit(l, p, e, d, local, d, st, rd.done, nd)
                    nd += 1
                    continue
                if rd.ncand[d] < K:
                    i = rd.ncand[d]
                    rd.cand[d, i] = code
                    rd.cand_e[d, i] = e
                    j0 = rd.cstart[d, i]
                    j = j0
                    h = st.hhead[l * E + e]
                    while h >= 0:
                        s = h - l * P
                        if not st.writing[l, s]:
                            t = j0
                            while t < j and rd.cols[d, t] != s // S:
                                t += 1
                            if t == j:
                                rd.cols[d, j] = s // S
                                rd.srcs[d, j] = s
                                j += 1
                                rd.adj[d, s // S] = True
                            elif s < rd.srcs[d, t]:
                                rd.srcs[d, t] = s
                        h = st.hnext[h]
                    rd.cstart[d, i + 1] = j
                    rd.ncand[d] += 1
            elif st.inflight[l, e]:
                continue                   # e's only copy is still being written
            elif tight and P - st.ndist[l] < 2 and st.npl[l] > 1:
                continue                   # the layer's last spare room: reload last
            elif rd.ncand[d] < K:          # lost with every replica: checkpoint reload
                i = rd.ncand[d]
                rd.cand[d, i] = code
                rd.cand_e[d, i] = e
                rd.cols[d, rd.cstart[d, i]] = G + d
                rd.srcs[d, rd.cstart[d, i]] = -1
                rd.cstart[d, i + 1] = rd.cstart[d, i] + 1
                rd.adj[d, G + d] = True
                rd.ncand[d] += 1
    return nd


@kernel
def schedule(old_LP, new_LP, G, E, chunk, per_rank, full_search, stop):
    """The plain rounds (`_rounds` without relays): see `_rounds`."""
    return _rounds(old_LP, new_LP, G, E, chunk, per_rank, False, full_search, stop)


@kernel
def schedule_relay(old_LP, new_LP, G, E, chunk, per_rank, full_search, stop):
    """The relay mode's rounds: see `_rounds`."""
    return _rounds(old_LP, new_LP, G, E, chunk, per_rank, True, full_search, stop)


@kernel(inline=True)
def _rounds(old_LP, new_LP, G, E, chunk, per_rank, relay, full_search, stop):
    """Rounds of copies from old_LP to new_LP; returns (out_M8, chunk_R, status, layer).

    out_M8 rows: (round, layer, expert, src rank (-1 checkpoint), src slot, dst rank,
    dst slot, staging). status STATUS_NO_SPARE names the layer that could not stage.
    chunk: layers per chunk (rounds never mix chunks); per_rank: K. relay: plan a balanced
    source per network copy, relays included (`_senders_kernel.plan_sources`), replanned every
    few rounds, instead of counting only the forced sends. Inlined into one entry point per
    mode, `relay` a constant there: the plain rounds carry no relay branch. full_search: break
    deadlocks from the full cycle search's list (`_find_cycles`) instead of `deadlocks`' own (the
    same rows: the reference the tests hold it to; always passed, so one compiled version).
    stop: int64 [1], read before each round: nonzero ends the schedule there (STATUS_STOPPED), so
    a caller on another thread can drop a schedule it no longer needs within a round.
    """
    L, P = new_LP.shape
    S = P // G
    st = _new_state(old_LP, new_LP, G, E)
    rd = _Round(np.empty((G, per_rank), dtype=np.int64), np.empty((G, per_rank), dtype=np.int64),
                np.zeros(G, dtype=np.int64), np.zeros((G, 2 * G), dtype=np.bool_),
                np.empty((G, per_rank * (G + 1)), dtype=np.int64), np.empty((G, per_rank * (G + 1)), dtype=np.int64),
                np.zeros((G, per_rank + 1), dtype=np.int64),
                np.empty((L * P + G, 7), dtype=np.int64),
                np.empty((G, 2 * G), dtype=np.int64), np.zeros(G, dtype=np.int64))
    sg = new_staging(new_LP, E, G)
    w = _Work(np.zeros(G, dtype=np.int64), np.zeros(G, dtype=np.int64), np.zeros(G, dtype=np.int64),
              np.full((L, P), -1, dtype=np.int32), np.zeros((L, P), dtype=np.int32),
              np.zeros(G, dtype=np.bool_), np.zeros(G, dtype=np.bool_), np.full((L, P), -1, dtype=np.int32),
              np.empty(L * S, dtype=np.int32), np.zeros(E, dtype=np.int64), np.zeros(E, dtype=np.int64),
              np.empty((L * P, 2), dtype=np.int32))
    out = np.empty((1024, 8), dtype=np.int64)
    chunk_R = np.empty(64, dtype=np.int64)
    # Spare room of a layer: P minus the experts it holds (empty slots and duplicates). Copies
    # keep it, reloads of lost experts use it up, and a cycle needs one unit to stage through:
    # a reload that would leave none waits until it is its layer's last pending slot. Only
    # with E >= P can a reload leave none (else it leaves >= P - E + 1 - 1 >= 1).
    tight = E >= P
    M = 0
    R = 0
    for chunk_id, c0 in enumerate(range(0, L, chunk)):
        c1 = min(L, c0 + chunk)
        left = _queue_chunk(st, c0, c1, S, P, w.depth)
        if relay:
            plan_sources(st, c0, c1, S, P, w.fsrc, w.rout)
        else:
            forced_sources(st, c0, c1, S, P, w.fsrc, w.rout, w.nh, w.hr)
        # Relay mode replans about 64 times per chunk's sends per rank (a plan goes stale as
        # the matching takes other sources than the planned ones).
        every = max(1, w.rout.sum() // (64 * G))
        r0 = R
        guard = 4 * (left + (c1 - c0) * P) + 8
        while left > 0:
            if stop[0] != 0:
                return out[:M], chunk_R[:R], STATUS_STOPPED, -1
            guard -= 1
            if guard <= 0:
                return out[:M], chunk_R[:R], STATUS_NO_PROGRESS, -1
            if tight:
                _count_room(st, c0, c1, E, P)
            if relay and R > r0 and (R - r0) % every == 0:
                plan_sources(st, c0, c1, S, P, w.fsrc, w.rout)
            nd = _round_copies(st, rd, sg, w, S, P, tight, relay, full_search)
            if nd == 0:
                return out[:M], chunk_R[:R], STATUS_NO_SPARE, pend_layer(st.pend, st.npend, P)
            _count_sends(st, rd.done, nd, w, S, relay)
            out, M = _apply_round(st, rd.done, nd, out, M, R)
            chunk_R = _grow(chunk_R, R + 1)
            chunk_R[R] = chunk_id
            R += 1
            left = _requeue(st, rd.done, nd, S, P, w.depth)
    return out[:M], chunk_R[:R], STATUS_OK, -1


@kernel(inline=True)
def _round_copies(st, rd, sg, w, S, P, tight, relay, full_search):
    """The copies of one round, as rows 0..nd-1 of rd.done; returns nd (0: nothing could move
    and no cycle could be staged)."""
    G = st.npend.size
    ndl = chain_order(st, sg, S, P, w.depth, w.key, w.rin)
    # Step 1: a rank is send-critical when the copies only it can send come within an eighth of
    # the rounds its busiest receiver still needs (its sends may set the rounds), and
    # receive-critical (late) when its own receives come within a round of them.
    rmax = w.rin.max()
    lim = rmax - max(2, rmax // 8)
    ncrit = 0
    for g in range(G):
        w.crit[g] = not relay and w.rout[g] >= 2 and w.rout[g] >= lim
        ncrit += w.crit[g]
        w.late[g] = w.rin[g] + 2 > rmax
    # Step 2: deadlocked cycles of blocked slots break as soon as they appear: first through
    # pending slots of their own ranks (free), before this round's copies take those; then
    # through the spares and links the round left; when nothing could move at all, every cycle
    # does. (Not with as many slots as experts: there the few spare slots wait for reloads.)
    # A deadlock at the round's start closes a chain into a cycle (the chain order finds them);
    # later in the round only through a replica this round's copies overwrite. `deadlocks`
    # lists both, walking from those alone (the full search walks every pending slot).
    staged = ndl > 0 and not tight
    nstart = ndl if staged else 0
    for c in range(nstart):
        code = sg.cyc_start[c]
        w.start[c, 0] = code // P
        w.start[c, 1] = st.cur[code // P, code % P]
    ns = 0
    if staged and full_search:
        ns = stage(st, sg, rd.done, S, P, 0, 0, w.rin, w.depth, FIND, w.crit, ncrit)
    elif staged:
        deadlocks(st, sg, rd.done, 0, S, P, w.start, nstart)
        ns = stage(st, sg, rd.done, S, P, 0, 0, w.rin, w.depth, LISTED, w.crit, ncrit)
    # Step 3: local copies and the link matching. A held slot may close a cycle of waits the
    # deadlock search does not know of: when nothing moved, the holds give way and the round is
    # tried again before anything is staged. (One call site each: numba inlines `_scan` and
    # `take_links` where called.)
    retried = False
    while True:
        nd = _scan(st, rd, S, P, tight, ns, w.hold_LP, w.late)
        nd = take_links(st, rd, nd, P, tight, w.rin, w.rout, w.sent, w.fsrc, relay, w.crit,
                        0 if retried else ncrit, w.late, w.depth, rmax, w.hold_LP)
        if nd > 0 or retried or not _release_holds(w.hold_LP, st.pend, st.npend, P):
            break
        retried = True
    # Step 4: the cycles left (the queues and slot contents have not changed since step 2: the
    # same cycles).
    if nd == 0:
        nd = stage(st, sg, rd.done, S, P, nd, 2, w.rin, w.depth, KEEP if staged and full_search else FIND,
                   w.crit, ncrit)
    elif staged and full_search:
        nd = stage(st, sg, rd.done, S, P, nd, 1, w.rin, w.depth, KEEP, w.crit, ncrit)
    elif not tight and deadlocks(st, sg, rd.done, nd, S, P, w.start, nstart) > 0:
        nd = stage(st, sg, rd.done, S, P, nd, 1, w.rin, w.depth, FIND if full_search else LISTED, w.crit, ncrit)
    return nd


@kernel(inline=True)
def _count_sends(st, done, nd, w, S, relay):
    """After a round's copies are chosen: staging marks, each rank's network sends, and the forced
    sources the copies used up."""
    for i in range(nd):
        if done[i, 6]:
            _stage_rows(st, done, i, S)
    for i in range(nd):
        if not relay and done[i, 4] >= 0 and done[i, 3] != done[i, 5]:
            w.sent[done[i, 3]] += 1
        f = w.fsrc[done[i, 0], done[i, 1]]
        if f >= 0:
            w.rout[f] -= 1
            w.fsrc[done[i, 0], done[i, 1]] = -1
