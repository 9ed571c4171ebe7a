"""Python reference of the migration schedule (`eplb.migration.schedule`), a test oracle.

Legend: L = MoE layers, E = logical experts, G = ranks, S = slots per rank, P = G x S slots.

The greedy rounds of the compiled schedule written with dicts and sets, and scipy's maximum
bipartite matching for each round's links. The tests replay both schedules with the same
checks; their rounds can differ (the kernel gives the link matching to the ranks with the
most copies left first).
"""

from __future__ import annotations

import numpy as np

from eplb.errors import EplbError
from eplb.migration import CHECKPOINT, MigrationPlan
from eplb.migration.schedule.rounds import CANDIDATES_PER_RANK, NO_SAFE_MIGRATION, check_schedule_input, plan_from_rows


def schedule(old_LP, new_LP, num_gpus: int, num_logical_experts: int, *, layers_per_chunk=None, rank_ids=None,
             bytes_per_expert=None) -> MigrationPlan:
    """`eplb.migration.schedule` in Python: dicts and sets per round, scipy's maximum bipartite
    matching for the links. Same input checks, same rules; its rounds can differ."""
    old_LP, new_LP, chunk, ranks = check_schedule_input(old_LP, new_LP, num_gpus, num_logical_experts,
                                                        layers_per_chunk, rank_ids)
    L, P = old_LP.shape
    S = P // num_gpus
    cols: list[tuple] = []
    chunk_R: list[int] = []
    for c, first in enumerate(range(0, L, chunk)):
        layers = range(first, min(L, first + chunk))
        _schedule_chunk(old_LP, new_LP, layers, S, num_gpus, num_logical_experts, c, cols, chunk_R)
    rows = np.asarray(cols, dtype=np.int64).reshape(-1, 8)
    return plan_from_rows(old_LP, new_LP, num_gpus, num_logical_experts, rows, chunk_R, ranks, bytes_per_expert)


def _schedule_chunk(old_LP, new_LP, layers, S, G, E, chunk_id, cols, chunk_R,
                    per_rank: int = CANDIDATES_PER_RANK) -> None:
    """Append the rounds of one layer chunk to cols / chunk_R (see `schedule`).

    Spare room of a layer: P minus the experts it holds (empty slots and duplicates). Copies
    keep it, reloads of lost experts use it up, and a cycle needs one unit to stage through:
    a reload that would leave none waits until it is its layer's last pending slot (with
    E < P every reload leaves some)."""
    P = G * S
    tight = E >= P
    cur = {l: old_LP[l].tolist() for l in layers}
    tgt = {l: new_LP[l].tolist() for l in layers}
    holders: dict[tuple[int, int], set] = {}
    for l in layers:
        for p, e in enumerate(cur[l]):
            if e >= 0:
                holders.setdefault((l, e), set()).add(p)
    pend: list[list[tuple[int, int]]] = [[] for _ in range(G)]
    for l in layers:
        for p in np.flatnonzero(old_LP[l] != new_LP[l]).tolist():
            pend[p // S].append((l, p))
    left = sum(len(q) for q in pend)
    # Staging slot -> (blocked slot, expert): the staging copy stays until the blocked slot
    # has been overwritten, or restoring it first would just recreate the cycle.
    staged_for: dict[tuple[int, int], tuple[int, int]] = {}
    guard = 4 * (left + len(layers) * len(cur[layers[0]]) if len(layers) else 0) + 8
    while left:
        guard -= 1
        assert guard > 0, "migration schedule does not converge (bug)"
        rnd = len(chunk_R)
        sourcing, done, inflight = set(), [], set()
        if tight:
            npl = {l: 0 for l in layers}
            for q in pend:
                for (l, _p) in q:
                    npl[l] += 1
            ndist = {l: sum(1 for e in range(E) if holders.get((l, e))) for l in layers}

        def commit(l, p, e, src, src_rank, d, sourcing=sourcing, inflight=inflight, done=done):
            o = cur[l][p]
            if o >= 0:
                holders[(l, o)].discard(p)
            sourcing.add((l, src))
            inflight.add((l, e))
            done.append((l, p, e, src_rank, src, d, False))

        # Scan: local copies are taken at once (no link); network and checkpoint candidates
        # (at most `per_rank` per destination rank) go to a matching of links.
        cand: list[list[tuple]] = [[] for _ in range(G)]
        rows, cols_ = [], []
        for d in range(G):
            for (l, p) in pend[d]:
                if (l, p) in sourcing:
                    continue
                if (l, p) in staged_for:
                    blocked, a = staged_for[(l, p)]
                    if cur[l][blocked] == a:
                        continue
                    del staged_for[(l, p)]
                o, e = cur[l][p], tgt[l][p]
                if o >= 0 and len(holders[(l, o)]) < 2:
                    continue                      # p holds the last complete replica of o
                hs = holders.get((l, e))
                if hs:
                    local = next((s for s in hs if s // S == d), None)
                    if local is not None:
                        commit(l, p, e, local, d, d)
                        continue
                    by_rank = {}
                    for s in hs:
                        by_rank.setdefault(s // S, s)
                elif (l, e) in inflight:
                    continue                      # e's only copy is still being written
                elif tight and P - ndist[l] < 2 and npl[l] > 1:
                    continue                      # the layer's last spare room: reload last
                else:
                    by_rank = {G + d: -1}         # lost with every replica: checkpoint reload
                if len(cand[d]) < per_rank:
                    cand[d].append((l, p, e, by_rank))
                    for r in by_rank:
                        rows.append(d)
                        cols_.append(r)
        # Each rank receives <= 1 and sends <= 1: a maximum matching of destination ranks to
        # source ranks (columns G + d stand for the checkpoint, one per destination).
        if rows:
            from scipy.sparse import csr_matrix
            from scipy.sparse.csgraph import maximum_bipartite_matching

            graph = csr_matrix((np.ones(len(rows)), (rows, cols_)), shape=(G, 2 * G))
            match = maximum_bipartite_matching(graph, perm_type="column")
            for d in range(G):
                r = int(match[d])
                if r < 0:
                    continue
                for (l, p, e, by_rank) in cand[d]:
                    if r not in by_rank or (l, p) in sourcing:
                        continue
                    o, src = cur[l][p], by_rank[r]
                    if any(t[0] == l and t[1] == p for t in done[-G:]):
                        continue
                    if o >= 0 and len(holders[(l, o)]) < 2:
                        continue                  # an earlier pick this round took o's spare
                    if src >= 0 and src not in holders.get((l, e), ()):
                        continue                  # the source is being written this round
                    if src < 0 and (l, e) in inflight:
                        continue
                    if src < 0 and tight:
                        if P - ndist[l] < 2 and npl[l] > 1:
                            continue              # another reload this round took the room
                        ndist[l] += 1
                    commit(l, p, e, src, CHECKPOINT if src < 0 else r, d)
                    break
        if not done:
            done = _stage_cycles(cur, tgt, holders, pend, S, staged_for)
            for (l, s_, a, _r, src, *_) in done:
                staged_for[(l, s_)] = (src, a)
        for (l, p, e, src_rank, src, d, staged) in done:
            if cur[l][p] >= 0:
                holders[(l, cur[l][p])].discard(p)
            cur[l][p] = e
            holders.setdefault((l, e), set()).add(p)
            cols.append((rnd, l, e, src_rank, src, d, p, staged))
        chunk_R.append(chunk_id)
        for g in range(G):
            pend[g] = [(l, p) for (l, p) in pend[g] if cur[l][p] != tgt[l][p]]
        # A staging copy makes its slot pending again (it must get its own expert back).
        for (l, p, *_rest) in done:
            if cur[l][p] != tgt[l][p] and (l, p) not in pend[p // S]:
                pend[p // S].append((l, p))
        left = sum(len(q) for q in pend)


def _stage_cycles(cur, tgt, holders, pend, S, staged_for):
    """Break every cycle of blocked slots at once, one staging copy per cycle.

    Slot p is blocked when it holds the last replica of its expert o; it waits for a
    pending slot whose target is o. Following these waits from any blocked slot ends in a
    cycle (everything is blocked when this runs). Per cycle, one member's expert is copied
    into a spare slot: a finished slot whose own expert has another complete replica,
    on the member's GPU if possible (no link), else over free links. Only when no finished
    slot is spare: a pending one that is empty or holds a duplicate and stages nothing yet
    (a layer with as many slots as experts whose lost experts' reloads wait for the end).
    """
    waiting_for: dict[tuple[int, int], list] = {}
    for q in pend:
        for (l, p) in q:
            waiting_for.setdefault((l, tgt[l][p]), []).append(p)
    state: dict[tuple[int, int], int] = {}                 # 1 = on the current walk, 2 = done
    cycles = []
    for q in pend:
        for start in q:
            path = []
            node = start
            while node is not None and state.get(node) is None:
                state[node] = 1
                path.append(node)
                l, p = node
                nxt = waiting_for.get((l, cur[l][p]), [])
                node = (l, nxt[0]) if nxt else None
            if node is not None and state.get(node) == 1:
                cycles.append(path[path.index(node):])
            for n in path:
                state[n] = 2
    out, used, send_busy, recv_busy = [], set(), set(), set()
    spares_by_layer: dict[int, tuple[list[int], list[int]]] = {}
    spare = lambda l, s: cur[l][s] < 0 or len(holders[(l, cur[l][s])]) >= 2  # noqa: E731
    for cyc in cycles:
        l = cyc[0][0]
        if l not in spares_by_layer:
            P = len(cur[l])
            spares_by_layer[l] = ([s for s in range(P) if cur[l][s] == tgt[l][s] and cur[l][s] >= 0 and spare(l, s)],
                                  [s for s in range(P) if cur[l][s] != tgt[l][s] and (l, s) not in staged_for
                                   and spare(l, s)])
        best = None
        for spares in spares_by_layer[l]:
            for (_, p) in cyc:
                for s in spares:
                    if (l, s) in used or not spare(l, s):
                        continue
                    if s // S == p // S:
                        best = (p, s)
                        break
                    if best is None and p // S not in send_busy and s // S not in recv_busy:
                        best = (p, s)
                if best is not None and best[1] // S == best[0] // S:
                    break
            if best is not None:
                break
        if best is None:
            continue
        p, s = best
        if s // S != p // S:
            send_busy.add(p // S)
            recv_busy.add(s // S)
        used.add((l, s))
        if cur[l][s] >= 0:
            holders[(l, cur[l][s])].discard(s)
        out.append((l, s, cur[l][p], p // S, p, s // S, True))
    if not out:
        raise EplbError(NO_SAFE_MIGRATION)
    return out
