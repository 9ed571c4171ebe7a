"""Compiled migration schedule (numba): `eplb.migration.schedule` without the Python loop.

Legend: L = MoE layers, E = logical experts, G = ranks, S = slots per rank, P = G x S slots,
K = candidates per destination rank and round, M = transfers.

The same greedy rounds as `migration._schedule_chunk` (the Python version, kept as the
reference the tests replay with the same checks), on flat arrays instead of dicts and sets:
- hc_LE counts each expert's *complete* replicas (slots that hold it and are not being
  written this round); writing_LP, sourcing_LP and inflight_LE are the round's flags;
- pend_GK lists each rank's pending slots (code l * P + p) in the reference's order;
- the links of a round are a maximum matching of destination ranks to source ranks, found
  by augmenting paths with the ranks that have the most copies left tried first (the
  reference asks scipy for any maximum matching), so the busiest receivers, which bound the
  number of rounds, are the last to wait.
Ties among replicas pick the lowest slot index. Releases the GIL: a serving thread keeps
running while a side thread schedules.
"""

from __future__ import annotations

import numpy as np
from numba import njit

NO_SOURCE = -2            # cand_src entry: this column (rank) holds no complete replica
STATUS_OK = 0
STATUS_NO_SPARE = -1      # every pending slot is blocked and no spare slot can stage
STATUS_NO_PROGRESS = -2   # the round guard ran out (a bug)


@njit(cache=True, nogil=True)
def _grow(a, n):
    """a with room for at least n rows (doubling), rows kept."""
    if n <= a.shape[0]:
        return a
    b = np.empty((max(n, 2 * a.shape[0]),) + a.shape[1:], dtype=a.dtype)
    b[:a.shape[0]] = a
    return b


@njit(cache=True, nogil=True)
def _match(adj, npend, G):
    """Maximum matching of destination ranks (rows) to columns (ranks 0..G-1, checkpoint
    G + d), rows with the most pending copies first; match_row[d] = column or -1."""
    C = adj.shape[1]
    match_row = np.full(G, -1, dtype=np.int64)
    match_col = np.full(C, -1, dtype=np.int64)
    parent = np.empty(C, dtype=np.int64)
    seen = np.empty(C, dtype=np.bool_)
    queue = np.empty(G, dtype=np.int64)
    for d in np.argsort(-npend, kind="mergesort"):
        seen[:] = False
        head, tail = 0, 1
        queue[0] = d
        end = -1
        while head < tail and end < 0:
            u = queue[head]
            head += 1
            for r in range(C):
                if not adj[u, r] or seen[r]:
                    continue
                seen[r] = True
                parent[r] = u
                if match_col[r] < 0:
                    end = r
                    break
                queue[tail] = match_col[r]
                tail += 1
        r = end
        while r >= 0:                       # flip the augmenting path
            u = parent[r]
            nxt = match_row[u]
            match_row[u] = r
            match_col[r] = u
            r = nxt
    return match_row


@njit(cache=True, nogil=True)
def _commit(l, p, e, src_rank, src, d, cur, hc, writing, sourcing, inflight, done, nd):
    """Take the copy of expert e into slot p (layer l) from slot src on rank src_rank (-1: the
    checkpoint) as row nd of this round: p stops being a complete replica of what it holds."""
    o = cur[l, p]
    if o >= 0:
        hc[l, o] -= 1
    writing[l, p] = True
    if src >= 0:
        sourcing[l, src] = True
    inflight[l, e] = True
    done[nd, 0] = l
    done[nd, 1] = p
    done[nd, 2] = e
    done[nd, 3] = src_rank
    done[nd, 4] = src
    done[nd, 5] = d
    done[nd, 6] = 0


@njit(cache=True, nogil=True)
def pend_layer(pend, npend, P):
    """Layer of the first pending slot (for the error message), or -1."""
    for d in range(npend.size):
        if npend[d]:
            return pend[d, 0] // P
    return -1


@njit(cache=True, nogil=True)
def _stage(cur, tgt, hc, writing, staged_blk, pend, npend, wf, state, path, cyc_buf, cyc_start, cyc_len,
           send_busy, recv_busy, done, G, S, P):
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
    for d in range(G):
        for k in range(npend[d]):
            l = pend[d, k] // P
            q = pend[d, k] % P
            if wf[l, tgt[l, q]] < 0:
                wf[l, tgt[l, q]] = q
    ncyc = 0
    nbuf = 0
    for d in range(G):
        for k in range(npend[d]):
            l = pend[d, k] // P
            n = 0
            node = pend[d, k] % P
            while node >= 0 and state[l, node] == 0:
                state[l, node] = 1
                path[n] = node
                n += 1
                o = cur[l, node]
                node = wf[l, o] if o >= 0 else -1
            if node >= 0 and state[l, node] == 1:
                j = 0
                while path[j] != node:
                    j += 1
                cyc_start[ncyc] = nbuf
                cyc_len[ncyc] = n - j
                for t in range(j, n):
                    cyc_buf[nbuf] = l * P + path[t]
                    nbuf += 1
                ncyc += 1
            for t in range(n):
                state[l, path[t]] = 2
    for d in range(G):                          # every walked slot is pending: reset them
        for k in range(npend[d]):
            l = pend[d, k] // P
            q = pend[d, k] % P
            state[l, q] = 0
            wf[l, tgt[l, q]] = -1
    send_busy[:] = False
    recv_busy[:] = False
    nd = 0
    for c in range(ncyc):
        l = cyc_buf[cyc_start[c]] // P
        bp = -1
        bs = -1
        for final in (True, False):
            for t in range(cyc_len[c]):
                p = cyc_buf[cyc_start[c] + t] % P
                for s in range(P):
                    x = cur[l, s]
                    if writing[l, s]:
                        continue
                    if final:
                        if x != tgt[l, s] or x < 0 or hc[l, x] < 2:
                            continue
                    elif x == tgt[l, s] or (x >= 0 and hc[l, x] < 2) or staged_blk[l, s] >= 0:
                        continue
                    if s // S == p // S:
                        bp = p
                        bs = s
                        break
                    if bp < 0 and not send_busy[p // S] and not recv_busy[s // S]:
                        bp = p
                        bs = s
                if bp >= 0 and bs // S == bp // S:
                    break
            if bp >= 0:
                break
        if bp < 0:
            continue
        if bs // S != bp // S:
            send_busy[bp // S] = True
            recv_busy[bs // S] = True
        writing[l, bs] = True
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


@njit(cache=True, nogil=True)
def schedule(old_LP, new_LP, G, E, chunk, per_rank):
    """Rounds of copies from old_LP to new_LP; returns (out_M8, chunk_R, status, layer).

    out_M8 rows: (round, layer, expert, src rank (-1 checkpoint), src slot, dst rank,
    dst slot, staging). status STATUS_NO_SPARE names the layer that could not stage.
    """
    L, P = new_LP.shape
    S = P // G
    cur = old_LP.copy()
    tgt = new_LP
    hc = np.zeros((L, E), dtype=np.int64)
    for l in range(L):
        for p in range(P):
            if cur[l, p] >= 0:
                hc[l, cur[l, p]] += 1
    writing = np.zeros((L, P), dtype=np.bool_)
    sourcing = np.zeros((L, P), dtype=np.bool_)
    inflight = np.zeros((L, E), dtype=np.bool_)
    inpend = np.zeros((L, P), dtype=np.bool_)
    staged_blk = np.full((L, P), -1, dtype=np.int64)     # staging slot -> blocked slot
    staged_exp = np.full((L, P), -1, dtype=np.int64)     # ... and the expert it holds
    pend = np.empty((G, L * S), dtype=np.int64)
    npend = np.zeros(G, dtype=np.int64)
    cand = np.empty((G, per_rank), dtype=np.int64)
    cand_e = np.empty((G, per_rank), dtype=np.int64)
    cand_src = np.empty((G, per_rank, 2 * G), dtype=np.int64)
    ncand = np.zeros(G, dtype=np.int64)
    adj = np.zeros((G, 2 * G), dtype=np.bool_)
    done = np.empty((L * P + G, 7), dtype=np.int64)      # l, p, e, src rank, src, d, staging
    out = np.empty((1024, 8), dtype=np.int64)
    chunk_R = np.empty(64, dtype=np.int64)
    wf = np.full((L, E), -1, dtype=np.int64)             # first pending slot waiting for (l, e)
    state = np.zeros((L, P), dtype=np.int8)              # cycle walk: 1 on the path, 2 done
    path = np.empty(P, dtype=np.int64)
    cyc_buf = np.empty(L * P, dtype=np.int64)
    cyc_start = np.empty(L * P, dtype=np.int64)
    cyc_len = np.empty(L * P, dtype=np.int64)
    send_busy = np.zeros(G, dtype=np.bool_)
    recv_busy = np.zeros(G, dtype=np.bool_)
    # Spare room of a layer: P minus the experts it holds (empty slots and duplicates). Copies
    # keep it, reloads of lost experts use it up, and a cycle needs one unit to stage through:
    # a reload that would leave none waits until it is its layer's last pending slot. Only
    # with E >= P can a reload leave none (else it leaves >= P - E + 1 - 1 >= 1).
    tight = E >= P
    ndist = np.zeros(L, dtype=np.int64)      # experts held per layer, round start + reloads
    npl = np.zeros(L, dtype=np.int64)        # pending slots per layer at round start
    M = 0
    R = 0
    for chunk_id, c0 in enumerate(range(0, L, chunk)):
        c1 = min(L, c0 + chunk)
        npend[:] = 0
        for l in range(c0, c1):
            for p in range(P):
                if old_LP[l, p] != new_LP[l, p]:
                    g = p // S
                    pend[g, npend[g]] = l * P + p
                    npend[g] += 1
                    inpend[l, p] = True
        left = npend.sum()
        guard = 4 * (left + (c1 - c0) * P) + 8
        while left > 0:
            guard -= 1
            if guard <= 0:
                return out[:M], chunk_R[:R], STATUS_NO_PROGRESS, -1
            nd = 0
            ncand[:] = 0
            if tight:
                for l in range(c0, c1):
                    npl[l] = 0
                    ndist[l] = 0
                    for e in range(E):
                        if hc[l, e] > 0:
                            ndist[l] += 1
                for d in range(G):
                    for k in range(npend[d]):
                        npl[pend[d, k] // P] += 1
            # Scan: local copies are taken at once (no link); network and checkpoint
            # candidates (at most per_rank per destination rank) go to the link matching.
            for d in range(G):
                for k in range(npend[d]):
                    code = pend[d, k]
                    l = code // P
                    p = code % P
                    if sourcing[l, p]:
                        continue
                    if staged_blk[l, p] >= 0:
                        if cur[l, staged_blk[l, p]] == staged_exp[l, p]:
                            continue               # its blocked slot still needs the copy
                        staged_blk[l, p] = -1
                    o = cur[l, p]
                    e = tgt[l, p]
                    if o >= 0 and hc[l, o] < 2:
                        continue                   # p holds the last complete replica of o
                    if hc[l, e] > 0:
                        local = -1
                        for j in range(S):
                            s = d * S + j
                            if cur[l, s] == e and not writing[l, s]:
                                local = s
                                break
                        if local >= 0:
                            _commit(l, p, e, d, local, d, cur, hc, writing, sourcing, inflight, done, nd)
                            nd += 1
                            continue
                        if ncand[d] < per_rank:
                            i = ncand[d]
                            cand[d, i] = code
                            cand_e[d, i] = e
                            cand_src[d, i, :] = NO_SOURCE
                            for s in range(P):
                                if cur[l, s] == e and not writing[l, s] and cand_src[d, i, s // S] == NO_SOURCE:
                                    cand_src[d, i, s // S] = s
                            ncand[d] += 1
                    elif inflight[l, e]:
                        continue                   # e's only copy is still being written
                    elif tight and P - ndist[l] < 2 and npl[l] > 1:
                        continue                   # the layer's last spare room: reload last
                    elif ncand[d] < per_rank:      # lost with every replica: checkpoint reload
                        i = ncand[d]
                        cand[d, i] = code
                        cand_e[d, i] = e
                        cand_src[d, i, :] = NO_SOURCE
                        cand_src[d, i, G + d] = -1
                        ncand[d] += 1
            # Each rank receives <= 1 and sends <= 1 over the network.
            adj[:, :] = False
            any_edge = False
            for d in range(G):
                for i in range(ncand[d]):
                    for r in range(2 * G):
                        if cand_src[d, i, r] != NO_SOURCE:
                            adj[d, r] = True
                            any_edge = True
            if any_edge:
                match_row = _match(adj, npend, G)
                for d in range(G):
                    r = match_row[d]
                    if r < 0:
                        continue
                    for i in range(ncand[d]):
                        src = cand_src[d, i, r]
                        if src == NO_SOURCE:
                            continue
                        code = cand[d, i]
                        l = code // P
                        p = code % P
                        e = cand_e[d, i]
                        if sourcing[l, p] or writing[l, p]:
                            continue
                        o = cur[l, p]
                        if o >= 0 and hc[l, o] < 2:
                            continue               # an earlier pick this round took o's spare
                        if src >= 0 and (cur[l, src] != e or writing[l, src]):
                            continue               # the source is being written this round
                        if src < 0 and inflight[l, e]:
                            continue
                        if src < 0 and tight:
                            if P - ndist[l] < 2 and npl[l] > 1:
                                continue           # another reload this round took the room
                            ndist[l] += 1
                        _commit(l, p, e, -1 if src < 0 else r, src, d, cur, hc, writing, sourcing, inflight,
                                done, nd)
                        nd += 1
                        break
            if nd == 0:
                # Every pending slot is blocked: break each cycle of "waits for" links with
                # one staging copy into a spare slot.
                nd = _stage(cur, tgt, hc, writing, staged_blk, pend, npend, wf, state, path, cyc_buf,
                            cyc_start, cyc_len, send_busy, recv_busy, done, G, S, P)
                if nd == 0:
                    return out[:M], chunk_R[:R], STATUS_NO_SPARE, pend_layer(pend, npend, P)
                for i in range(nd):
                    staged_blk[done[i, 0], done[i, 1]] = done[i, 4]
                    staged_exp[done[i, 0], done[i, 1]] = done[i, 2]
            # Apply the round.
            out = _grow(out, M + nd)
            for i in range(nd):
                l = done[i, 0]
                p = done[i, 1]
                e = done[i, 2]
                cur[l, p] = e
                hc[l, e] += 1
                writing[l, p] = False
                if done[i, 4] >= 0:
                    sourcing[l, done[i, 4]] = False
                inflight[l, e] = False
                out[M, 0] = R
                out[M, 1] = l
                out[M, 2] = e
                out[M, 3] = done[i, 3]
                out[M, 4] = done[i, 4]
                out[M, 5] = done[i, 5]
                out[M, 6] = p
                out[M, 7] = done[i, 6]
                M += 1
            chunk_R = _grow(chunk_R, R + 1)
            chunk_R[R] = chunk_id
            R += 1
            for d in range(G):
                n = 0
                for k in range(npend[d]):
                    code = pend[d, k]
                    if cur[code // P, code % P] != tgt[code // P, code % P]:
                        pend[d, n] = code
                        n += 1
                    else:
                        inpend[code // P, code % P] = False
                npend[d] = n
            # A staging copy makes its slot pending again (it must get its own expert back).
            for i in range(nd):
                l = done[i, 0]
                p = done[i, 1]
                if cur[l, p] != tgt[l, p] and not inpend[l, p]:
                    g = p // S
                    pend[g, npend[g]] = l * P + p
                    npend[g] += 1
                    inpend[l, p] = True
            left = npend.sum()
    return out[:M], chunk_R[:R], STATUS_OK, -1
