"""Compiled link matching of the migration schedule (numba): which copies cross the network.

Legend: G = ranks, S = slots per rank, P = G x S slots, K = candidates per destination rank.

Stages of `_rounds_kernel.schedule`: in every round each rank receives at most one and
sends at most one expert over the network. `take_links` (inlined into the schedule) matches
destination ranks to source columns (ranks 0..G-1, checkpoint G + d) with `_match` and
takes, per matched rank, its first candidate still possible; `commit` records one copy (the
scan takes local copies with it too); `_exchange_stage` spares a send-critical rank the send an
exchange would leave to it. `st` is the schedule's state (`_state_kernel._Slots`),
`rd` the round's candidates (`_state_kernel._Round`).
"""

from __future__ import annotations

import numpy as np

from eplb.core.jit import kernel
from eplb.migration.schedule._stage_kernel import FINAL, PENDING, _left_to_critical, _spare


@kernel
def _match(adj, pref, npref, rin, rout, G, relay):
    """Maximum matching of destination ranks (rows) to columns (ranks 0..G-1, checkpoint
    G + d), rows with the most network copies still to receive first (they bound the
    rounds); then each source rank left out takes over a row from a source rank with fewer
    copies only it can send (rout), so that the busiest senders send too (the matching stays
    as large); with relay (rout: planned sends left, `_senders_kernel`) it takes the row over
    through an alternating path that may end at any column of fewer planned sends
    (`_cover_senders`). match_row[d] = column or -1.

    A row whose search finds no augmenting path leaves every column it reached dead: they are
    all matched, their rows reach only each other, and no later augmenting path can pass
    through them (it could not leave them to end at a free column), so later searches skip
    them. The paths found are the ones the full search finds: it reaches the same live
    columns in the same order."""
    C = adj.shape[1]
    match_row = np.full(G, -1, dtype=np.int64)
    match_col = np.full(C, -1, dtype=np.int64)
    parent = np.empty(C, dtype=np.int64)
    seen = np.zeros(C, dtype=np.int64)      # the search (1, 2, ...) that reached a column last
    dead = np.zeros(C, dtype=np.bool_)
    reached = np.empty(C, dtype=np.int64)
    queue = np.empty(G, dtype=np.int64)
    mark = 0
    for d in np.argsort(-rin, kind="mergesort"):
        mark += 1
        nreached = 0
        head, tail = 0, 1
        queue[0] = d
        end = -1
        while head < tail and end < 0:
            u = queue[head]
            head += 1
            for j in range(npref[u]):
                r = pref[u, j]
                if seen[r] == mark or dead[r]:
                    continue
                seen[r] = mark
                reached[nreached] = r
                nreached += 1
                parent[r] = u
                if match_col[r] < 0:
                    end = r
                    break
                queue[tail] = match_col[r]
                tail += 1
        if end < 0:
            for i in range(nreached):
                dead[reached[i]] = True
        r = end
        while r >= 0:                       # flip the augmenting path
            u = parent[r]
            nxt = match_row[u]
            match_row[u] = r
            match_col[r] = u
            r = nxt
    if relay:
        _cover_senders(pref, npref, rout, G, match_row, match_col, parent)
        return match_row
    # Rows by source column (ascending), for the takeovers: a rank's rows without a scan of all G.
    cptr, rows = _rows_by_column(pref, npref, G, G)
    for c in np.argsort(-rout, kind="mergesort"):
        if rout[c] == 0:
            break
        if match_col[c] >= 0:
            continue
        for i in range(cptr[c], cptr[c + 1]):
            d = rows[i]
            c1 = match_row[d]
            if 0 <= c1 < G and rout[c1] < rout[c]:
                match_row[d] = c
                match_col[c] = d
                match_col[c1] = -1
                break
    return match_row


@kernel(inline=True)
def _rows_by_column(pref, npref, G, C):
    """The transpose of the G rows' candidate columns pref[d, :npref[d]], keeping columns < C:
    (cptr [C + 1], rows), column c's rows in ascending order at rows[cptr[c]:cptr[c + 1]]."""
    cptr = np.zeros(C + 1, dtype=np.int64)
    for d in range(G):
        for j in range(npref[d]):
            if pref[d, j] < C:
                cptr[pref[d, j] + 1] += 1
    for c in range(C):
        cptr[c + 1] += cptr[c]
    fill = cptr[:C].copy()
    rows = np.empty(cptr[C], dtype=np.int64)
    for d in range(G):
        for j in range(npref[d]):
            c = pref[d, j]
            if c < C:
                rows[fill[c]] = d
                fill[c] += 1
    return cptr, rows


@kernel(inline=True)
def _cover_senders(pref, npref, rout, G, match_row, match_col, parent):
    """Each source rank left out of the matching, the most planned sends left (rout) first,
    takes a row through an alternating path c - d1 - c1 - d2 - c2 ... (d_i matched to c_i)
    that ends at a column with fewer planned sends (or a checkpoint column), flipped: every
    matched row stays matched, so the matching stays as large, and the matched columns move
    towards the busiest senders (Mendelsohn-Dulmage). Updates match_row, match_col."""
    C = match_col.size
    # Rows by column (the transpose of pref), for the alternating paths.
    cptr, crow = _rows_by_column(pref, npref, G, C)
    cq = np.empty(C, dtype=np.int64)
    pcol = np.empty(C, dtype=np.int64)
    seen = np.zeros(C, dtype=np.int64)      # the walk (1, 2, ...) that reached a column last
    mark = 0
    for c in np.argsort(-rout, kind="mergesort"):
        if rout[c] == 0:
            break
        if match_col[c] >= 0:
            continue
        mark += 1
        seen[c] = mark
        head, tail = 0, 1
        cq[0] = c
        end = -1
        while head < tail and end < 0:
            u = cq[head]
            head += 1
            for t in range(cptr[u], cptr[u + 1]):
                d = crow[t]
                c1 = match_row[d]
                if c1 < 0 or seen[c1] == mark:
                    continue
                seen[c1] = mark
                parent[c1] = d
                pcol[c1] = u
                if c1 >= G or rout[c1] < rout[c]:
                    end = c1
                    break
                cq[tail] = c1
                tail += 1
        if end < 0:
            continue
        match_col[end] = -1
        x = end
        while x != c:
            d = parent[x]
            u = pcol[x]
            match_row[d] = u
            match_col[u] = d
            x = u


@kernel(inline=True)
def commit(l, p, e, src_rank, src, d, st, done, nd):
    """Take the copy of expert e into slot p (layer l) from slot src on rank src_rank (-1: the
    checkpoint) as row nd of this round: p stops being a complete replica of what it holds."""
    o = st.cur[l, p]
    if o >= 0:
        st.hc[l, o] -= 1
    st.writing[l, p] = True
    if src >= 0:
        st.sourcing[l, src] = True
    st.inflight[l, e] = True
    done[nd, 0] = l
    done[nd, 1] = p
    done[nd, 2] = e
    done[nd, 3] = src_rank
    done[nd, 4] = src
    done[nd, 5] = d
    done[nd, 6] = 0


@kernel(inline=True)
def held_back(hold_LP, cur, tgt, l, p, late):
    """Does pending slot p (hold_LP[l, p] >= 0) still keep its expert for the slot of an exchange
    (`_exchange_stage`), which has not taken it yet? late: p's rank is receive-critical now, so p
    lets go (the hold is dropped)."""
    q = hold_LP[l, p]
    if not late and cur[l, q] != cur[l, p] and tgt[l, q] == cur[l, p]:
        return True
    hold_LP[l, p] = -1
    return False


@kernel(inline=True)
def _exchange_stage(st, crit, l, p, src, S, P, depth, rin, rmax, done, nd, hold_LP):
    """Pending slot p (layer l) is about to take its target from slot src on a rank that is not
    send-critical, and src waits for p's expert o while it holds the only complete replica of its
    own (an exchange of two slots: the caller checked these). When every other complete replica of
    o is on a send-critical rank (crit), that rank would have to send o to src afterwards, a send
    its rounds cannot spare; instead src's expert is first staged into a spare slot of src's rank
    (a local copy, no link) and p keeps o until src has it (`held_back`). Returns the new row
    count (nd: nothing staged, p may take its copy)."""
    if not _left_to_critical(st, crit, l, p, st.cur[l, p], S, P):
        return nd                          # a rank that is not critical can send o too
    r = src // S
    best = -1
    bw = 0
    for s in range(r * S, r * S + S):
        x = st.cur[l, s]
        if s == src:
            continue
        kind = _spare(x, st.tgt[l, s], st.writing[l, s] or st.sourcing[l, s], st.hc[l, x] if x >= 0 else 0,
                      st.staged_blk[l, s] >= 0)
        # A pending spare is free unless its own wait becomes the longest; a final one takes
        # one more copy into rank r later (its restore), free while r is not receive-critical.
        if kind == PENDING and depth[l, s] + 2 <= rmax:
            w = depth[l, s]
        elif kind == FINAL and rin[r] + 2 <= rmax:
            w = rmax + rin[r]
        else:
            continue
        if best < 0 or w < bw:
            best = s
            bw = w
    if best < 0:
        return nd
    if st.cur[l, best] == st.tgt[l, best]:
        rin[r] += 1                        # the final slot's restore (as `_stage_kernel.stage`)
    commit(l, best, st.cur[l, src], r, src, r, st, done, nd)
    done[nd, 6] = 1
    hold_LP[l, p] = src
    return nd + 1


@kernel(inline=True)
def _send_key(r, d, rout, sent, f, G):
    """Order of source column r for destination rank d (lower first): the candidate's planned
    source f (relay mode; else -1) first; then r's sends so far plus those only r can make (its
    least total; in relay mode sent is 0 and rout the planned sends left), then the distance
    from d round the ranks (the checkpoint column G + d last)."""
    if r >= G:
        return np.iinfo(np.int64).max
    if r == f:
        return -1
    return (rout[r] + sent[r]) * (G + 1) + (r - d) % G


@kernel(inline=True)
def take_links(st, rd, nd, P, tight, rin, rout, sent, fsrc, relay, crit, ncrit, late, depth, rmax, hold_LP):
    """Each rank receives <= 1 and sends <= 1 over the network: match destination ranks to
    source columns (ranks 0..G-1, checkpoint G + d) and take, per matched rank, its first
    candidate that is still possible. relay: fsrc holds each candidate's planned source (tried
    first) and rout the planned sends (`_senders_kernel.plan_sources`). crit, late: the
    send-critical and receive-critical ranks (ncrit of the first), rmax the most rounds a rank's
    receives still need, depth the chain lengths, hold_LP the slots kept for an exchange (all
    for `_exchange_stage`). Returns the copies of the round so far."""
    G = st.npend.size
    cur, hc = st.cur, st.hc
    any_edge = False                   # (every candidate has a source: rd.adj has its links)
    for d in range(G):
        if rd.ncand[d] > 0:
            any_edge = True
    if not any_edge:
        return nd
    pref, npref = rd.pref, rd.npref
    for d in range(G):
        npref[d] = 0
        for i in range(rd.ncand[d]):
            first = npref[d]
            f = fsrc[rd.cand[d, i] // P, rd.cand[d, i] % P] if relay else -1
            only = False                       # relay mode: the planned source alone, where it holds the expert
            if f >= 0:
                for j in range(rd.cstart[d, i], rd.cstart[d, i + 1]):
                    if rd.cols[d, j] == f:
                        only = True
            for j in range(rd.cstart[d, i], rd.cstart[d, i + 1]):
                r = rd.cols[d, j]
                if rd.adj[d, r] and (not only or r == f):
                    rd.adj[d, r] = False       # listed: the first candidate with a source there
                    pref[d, npref[d]] = r
                    npref[d] += 1
            # A candidate's sources: the ranks with the fewest sends only they can make first, ties
            # from rank d on (lowest indices first would pile the free sends on rank 0, 1, ...).
            for a in range(first + 1, npref[d]):
                r = pref[d, a]
                b = a
                while b > first and _send_key(pref[d, b - 1], d, rout, sent, f, G) > _send_key(r, d, rout, sent, f, G):
                    pref[d, b] = pref[d, b - 1]
                    b -= 1
                pref[d, b] = r
        for j in range(npref[d]):
            rd.adj[d, pref[d, j]] = True
    match_row = _match(rd.adj, pref, npref, rin, rout, G, relay)
    for d in range(G):
        r = match_row[d]
        if r < 0:
            continue
        for i in range(rd.ncand[d]):
            t = rd.cstart[d, i]
            while t < rd.cstart[d, i + 1] and rd.cols[d, t] != r:
                t += 1
            if t == rd.cstart[d, i + 1]:
                continue                   # no source in column r
            src = rd.srcs[d, t]
            code = rd.cand[d, i]
            l = code // P
            p = code % P
            e = rd.cand_e[d, i]
            if st.sourcing[l, p] or st.writing[l, p]:
                continue
            o = cur[l, p]
            if o >= 0 and hc[l, o] < 2:
                continue               # an earlier pick this round took o's spare
            if src >= 0 and (cur[l, src] != e or st.writing[l, src]):
                continue               # the source is being written this round
            if src < 0 and st.inflight[l, e]:
                continue
            if hold_LP[l, p] >= 0 and held_back(hold_LP, cur, st.tgt, l, p, late[d]):
                continue
            if ncrit > 0 and o >= 0 and src >= 0 and not crit[d] and not late[d] and not crit[r] \
                    and st.tgt[l, src] == o and hc[l, cur[l, src]] < 2:
                n2 = _exchange_stage(st, crit, l, p, src, P // G, P, depth, rin, rmax, rd.done, nd, hold_LP)
                if n2 > nd:
                    nd = n2
                    continue           # p waits; the link goes to a later candidate
            if src < 0 and tight:
                if P - st.ndist[l] < 2 and st.npl[l] > 1:
                    continue           # another reload this round took the room
                st.ndist[l] += 1
            commit(l, p, e, -1 if src < 0 else r, src, d, st, rd.done, nd)
            nd += 1
            break
    return nd
