"""Reference twins of the migration kernels: numpy, scipy and plain Python, kept as test oracles.

Legend: L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU, P = G x S slots,
R = L x G rows of S slots, A = layers still being improved, H = busy GPUs priced per layer,
C = partner GPUs, Q = C x S partner slots, D = donor slots.

Each function computes what a numba kernel of `eplb.migration` computes, written the obvious
way (whole-array numpy, scipy's matchings, dicts and sets), and the tests compare them:
- `count_moves`, `keep_counts`, `keep_slots`: equal outputs;
- `gpu_assignment` (scipy's linear_sum_assignment): the same kept totals (ties may differ);
- `budgeted_search`: identical placements (same float64 arithmetic in the same order, same
  first-maximum tie-breaking), from the same `SearchState`; it does not price group span;
- `schedule`: both schedules pass the same replay (their rounds can differ: the kernel gives
  the link matching to the ranks with the most copies left first, this one takes scipy's).
Benchmarks import `schedule` to time the compiled schedule against it.
"""

from __future__ import annotations

import numpy as np

from eplb.errors import EplbError
from eplb.migration import CHECKPOINT, MigrationPlan, holdings
from eplb.migration.checks import check_maps
from eplb.migration.schedule import CANDIDATES_PER_RANK, NO_SAFE_MIGRATION, check_schedule_input, plan_from_rows
from eplb.migration.search import Budget, prepare_search

# Moves and relabelling ---------------------------------------------------------------------------

def count_moves(old_LP, new_LP, num_gpus: int, num_logical_experts: int) -> np.ndarray:
    """`eplb.migration.count_moves` from [L, G, E] holdings."""
    check_maps(num_gpus, num_logical_experts, old_LP=old_LP, new_LP=new_LP)
    old = holdings(old_LP, num_gpus, num_logical_experts) > 0
    new = holdings(new_LP, num_gpus, num_logical_experts) > 0
    return (new & ~old).sum(axis=2)


def keep_counts(old_LP, new_LP, num_gpus: int, num_logical_experts: int) -> np.ndarray:
    """`eplb.migration.moves._keep_counts` as a batched matmul of holdings."""
    check_maps(num_gpus, num_logical_experts, old_LP=old_LP, new_LP=new_LP)
    old_h = (holdings(old_LP, num_gpus, num_logical_experts) > 0).astype(np.float64)
    new_h = (holdings(new_LP, num_gpus, num_logical_experts) > 0).astype(np.float64)
    return new_h @ old_h.transpose(0, 2, 1)


def gpu_assignment(keep_LGG: np.ndarray, num_nodes: int) -> np.ndarray:
    """`eplb.migration.moves._gpu_assignment` with scipy's linear_sum_assignment."""
    from scipy.optimize import linear_sum_assignment

    L, G, _ = keep_LGG.shape
    out = np.empty((L, G), dtype=np.int64)
    if num_nodes == 1:
        for l in range(L):
            rows, cols = linear_sum_assignment(keep_LGG[l], maximize=True)
            out[l, cols] = rows
        return out
    n = G // num_nodes
    for l in range(L):
        node_keep = np.empty((num_nodes, num_nodes))
        inner = {}
        for a in range(num_nodes):
            for b in range(num_nodes):
                block = keep_LGG[l, a * n:(a + 1) * n, b * n:(b + 1) * n]
                rows, cols = linear_sum_assignment(block, maximize=True)
                node_keep[a, b] = block[rows, cols].sum()
                inner[a, b] = (rows, cols)
        na, nb = linear_sum_assignment(node_keep, maximize=True)
        for a, b in zip(na, nb):
            rows, cols = inner[a, b]
            out[l, b * n + cols] = a * n + rows
    return out


def keep_slots(old_LP, new_LP, num_gpus: int) -> np.ndarray:
    """`eplb.migration.keep_slots` with sorts and broadcast comparisons."""
    old_LP = np.asarray(old_LP)
    new_LP = np.asarray(new_LP)
    L, P = check_maps(num_gpus, max(int(old_LP.max(initial=0)), int(new_LP.max(initial=0))) + 1,
                      old_LP=old_LP, new_LP=new_LP)
    G, S = num_gpus, P // num_gpus
    moved_LP = new_LP
    # Match the k-th copy of expert e in the new slots to the k-th copy of e
    # in the old slots (keys e * S + k are unique within a GPU) and keep matched ones in place.
    R = L * G
    new_RS = moved_LP.reshape(R, S)
    old_RS = old_LP.reshape(R, S)

    def keys(x_RS):
        order = np.argsort(x_RS, axis=1, kind="stable")
        xs = np.take_along_axis(x_RS, order, axis=1)
        run_start = np.concatenate([np.ones((R, 1), bool), xs[:, 1:] != xs[:, :-1]], axis=1)
        idx = np.where(run_start, np.arange(S)[None, :], 0)
        occ = np.arange(S)[None, :] - np.maximum.accumulate(idx, axis=1)
        k = np.empty_like(occ)
        np.put_along_axis(k, order, occ, axis=1)
        return np.where(x_RS >= 0, x_RS * S + k, -1 - np.arange(S)[None, :])  # empties never match

    kn, ko = keys(new_RS), keys(old_RS)
    eq_RSS = kn[:, :, None] == ko[:, None, :]
    matched_RS = eq_RSS.any(axis=2)                          # new slot j keeps an old position
    pos_RS = eq_RSS.argmax(axis=2)
    taken_RS = eq_RSS.any(axis=1)                            # old position already kept
    src_RS = np.full((R, S), -1, dtype=np.int64)             # new slot (within GPU) for each position
    r_idx, j_idx = np.nonzero(matched_RS)
    src_RS[r_idx, pos_RS[r_idx, j_idx]] = j_idx
    # Unmatched new slots fill the free positions, both in order.
    free_order = np.argsort(taken_RS, axis=1, kind="stable")        # free positions first
    unm_order = np.argsort(matched_RS, axis=1, kind="stable")       # unmatched slots first
    n_free = (~taken_RS).sum(axis=1)
    fill = np.arange(S)[None, :] < n_free[:, None]
    rr = np.broadcast_to(np.arange(R)[:, None], (R, S))
    src_RS[rr[fill], free_order[fill]] = unm_order[fill]
    assert (src_RS >= 0).all()
    within_LP = src_RS.reshape(L, P) + (np.arange(P) // S * S)[None, :]
    return within_LP


# Budgeted search -----------------------------------------------------------------------------------

def budgeted_search(load_LE, old_LP, num_gpus: int, budget: Budget, *, num_nodes=1, num_expert_groups=None,
                    donors=8, partners=8, max_iters=None) -> np.ndarray:
    """`eplb.migration.budgeted_search` pricing every active layer's candidates with whole-array
    numpy operations per iteration, from the same checked `SearchState` as the kernel."""
    st = prepare_search(load_LE, old_LP, num_gpus, budget, num_nodes=num_nodes, num_expert_groups=num_expert_groups,
                        donors=donors, partners=partners, max_iters=max_iters)
    if st.span_price > 0:
        raise EplbError("the numpy reference does not price group span: compare it with num_nodes=1 "
                        "or span_cost=0")
    phy, load_LE, cnt_LEG, old_LEG, r_LE, in_G = st.phy_LP, st.load_LE, st.cnt_LEG, st.old_LEG, st.r_LE, st.in_G
    G, S, C, D, iters = st.num_gpus, st.slots_per_gpu, st.partners, st.donors, st.iters
    if G < 2:
        return phy
    P = G * S
    gpu_P = np.arange(P) // S
    state = {"total": st.total}
    cap_total, cap_gpu, min_gain_L, active = st.cap_total, st.cap_gpu, st.min_gain_L, st.active_A
    H = 1                                                       # busy GPUs priced per layer
    s_idx = np.arange(S)
    gpu_G = np.arange(G)

    def fits(g_list, d_list):
        """Can every change of a batch be paid for, in any order? (positive parts only)"""
        pos = [np.maximum(d, 0) for d in d_list]
        if sum(int(p.sum()) for p in pos) > cap_total - state["total"]:
            return False
        if np.isfinite(cap_gpu):
            need = np.zeros(G, dtype=np.int64)
            for g, p in zip(g_list, pos):
                np.add.at(need, g, p)
            return bool((in_G + need <= cap_gpu).all())
        return True

    def apply_swaps(l, a_slot, q):
        """Swap slot a_slot with slot q in layers l (distinct layers); False where the budget refused."""
        hh, g = gpu_P[a_slot], gpu_P[q]
        ea, eb = phy[l, a_slot], phy[l, q]
        dg = (~old_LEG[l, ea, g]).astype(np.int64) - ((~old_LEG[l, eb, g]) & (cnt_LEG[l, eb, g] == 1))
        dh = (~old_LEG[l, eb, hh]).astype(np.int64) - ((~old_LEG[l, ea, hh]) & (cnt_LEG[l, ea, hh] == 1))
        ok = np.ones(l.size, dtype=bool)
        if not fits((g, hh), (dg, dh)):
            # The budget binds: one at a time, best first (callers pass them in that order).
            for k in range(l.size):
                t = state["total"] + dg[k] + dh[k]
                if t > cap_total or in_G[g[k]] + dg[k] > cap_gpu or in_G[hh[k]] + dh[k] > cap_gpu:
                    ok[k] = False
                    continue
                in_G[g[k]] += dg[k]
                in_G[hh[k]] += dh[k]
                state["total"] = int(t)
        else:
            np.add.at(in_G, g, dg)
            np.add.at(in_G, hh, dh)
            state["total"] += int(dg.sum() + dh.sum())
        l, a_slot, q, hh, g, ea, eb = (x[ok] for x in (l, a_slot, q, hh, g, ea, eb))
        phy[l, a_slot], phy[l, q] = eb, ea
        cnt_LEG[l, ea, hh] -= 1
        cnt_LEG[l, eb, hh] += 1
        cnt_LEG[l, eb, g] -= 1
        cnt_LEG[l, ea, g] += 1
        return ok

    def apply_reps(l, a_slot, q):
        """Copy the expert of slot a_slot over donor slot q in layers l (distinct layers)."""
        g = gpu_P[q]
        x, b = phy[l, a_slot], phy[l, q]
        dg = (~old_LEG[l, x, g]).astype(np.int64) - ((~old_LEG[l, b, g]) & (cnt_LEG[l, b, g] == 1))
        ok = np.ones(l.size, dtype=bool)
        if not fits((g,), (dg,)):
            for k in range(l.size):
                t = state["total"] + dg[k]
                if t > cap_total or in_G[g[k]] + dg[k] > cap_gpu:
                    ok[k] = False
                    continue
                in_G[g[k]] += dg[k]
                state["total"] = int(t)
        else:
            np.add.at(in_G, g, dg)
            state["total"] += int(dg.sum())
        l, q, g, x, b = (v[ok] for v in (l, q, g, x, b))
        phy[l, q] = x
        cnt_LEG[l, b, g] -= 1
        cnt_LEG[l, x, g] += 1
        r_LE[l, b] -= 1
        r_LE[l, x] += 1
        return ok

    for _ in range(iters):
        if active.size == 0:
            break
        A = active.size
        ar = np.arange(A)
        ph = phy[active]                                          # [A, P]
        ld = load_LE[active]                                      # [A, E]
        r = r_LE[active]
        w_AP = np.take_along_axis(ld / r, ph, axis=1)             # load of each replica
        # Summed slot by slot (not .sum, whose pairwise order depends on S) so the compiled
        # kernel can reproduce the same float64 loads exactly.
        w_AGS = w_AP.reshape(A, G, S)
        gl_AG = w_AGS[:, :, 0].copy()
        for s in range(1, S):
            gl_AG += w_AGS[:, :, s]
        srt = np.argsort(-gl_AG, axis=1, kind="stable")
        h = srt[:, 0]                                             # busiest GPU
        Lh = gl_AG[ar, h]
        room_G = cap_gpu - in_G
        room_tot = cap_total - state["total"]
        la2 = active[:, None]
        la3 = active[:, None, None]
        h2 = h[:, None]
        need_A = min_gain_L[active]

        # Swap: slot a on the busiest GPU (axis H, one row) <-> slot q on one of the C lightest
        # GPUs (heavier partners seldom help and would cost G / C times the work).
        hr_AH = srt[:, :H]
        Lr_AH = np.take_along_axis(gl_AG, hr_AH, axis=1)
        hs_AHS = hr_AH[:, :, None] * S + s_idx                   # slots of the busy GPUs
        ea_AHS = np.take_along_axis(ph, hs_AHS.reshape(A, H * S), axis=1).reshape(A, H, S)
        wa_AHS = np.take_along_axis(w_AP, hs_AHS.reshape(A, H * S), axis=1).reshape(A, H, S)
        light_AC = srt[:, ::-1][:, :C]
        q_AQ = (light_AC[:, :, None] * S + s_idx).reshape(A, C * S)
        g_AQ = gpu_P[q_AQ]
        eb_AQ = np.take_along_axis(ph, q_AQ, axis=1)
        w_AQ = np.take_along_axis(w_AP, q_AQ, axis=1)
        gl_AQ = np.take_along_axis(gl_AG, g_AQ, axis=1)
        delta = wa_AHS[..., None] - w_AQ[:, None, None, :]       # [A, H, S, Q] load leaving h
        # Gains are local: how far the busy GPU drops while the GPUs the change touches
        # stay below its old load. The global maximum never rises, and a layer with several
        # near-busiest GPUs still sees each step as progress.
        Lr4 = Lr_AH[:, :, None, None]
        swap_gain = Lr4 - np.maximum(Lr4 - delta, gl_AQ[:, None, None, :] + delta)
        # Counts of each busy-GPU expert on every GPU, gathered once: [A, H, S, G].
        cnt_x_AHSG = cnt_LEG[la3, ea_AHS]
        old_x_AHSG = old_LEG[la3, ea_AHS]
        # Per partner GPU, then repeated over its S slots (S times fewer gathers).
        light4 = np.broadcast_to(light_AC[:, None, None, :], (A, H, S, C))
        cn_g_ea = np.repeat(np.take_along_axis(cnt_x_AHSG, light4, axis=3), S, axis=3)
        ol_g_ea = np.repeat(np.take_along_axis(old_x_AHSG, light4, axis=3), S, axis=3)
        hr3 = hr_AH[:, :, None]
        cn_h_eb = cnt_LEG[la3, eb_AQ[:, None, :], hr3]            # [A, H, Q]
        ol_h_eb = old_LEG[la3, eb_AQ[:, None, :], hr3]
        cn_h_ea = np.take_along_axis(cnt_x_AHSG, hr3[..., None], axis=3)[..., 0]    # [A, H, S]
        ol_h_ea = np.take_along_axis(old_x_AHSG, hr3[..., None], axis=3)[..., 0]
        cn_g_eb = cnt_LEG[la2, eb_AQ, g_AQ]                       # [A, Q]
        # Moves against the old placement: an expert landing on a GPU that did not hold it
        # costs 1; one leaving a GPU it was moved onto (its only copy there) refunds 1.
        d_g = (~ol_g_ea).astype(np.int64) - ((~old_LEG[la2, eb_AQ, g_AQ]) & (cn_g_eb == 1))[:, None, None, :]
        d_h = ((~ol_h_eb).astype(np.int64)[:, :, None, :] - ((~ol_h_ea) & (cn_h_ea == 1))[..., None])
        swap_cost = d_g + d_h
        bad = (cn_g_ea > 0) | (cn_h_eb > 0)[:, :, None, :] | (ea_AHS[..., None] == eb_AQ[:, None, None, :])
        bad |= (g_AQ[:, None, None, :] == hr_AH[:, :, None, None])
        bad |= ((d_g > room_G[g_AQ][:, None, None, :]) | (d_h > room_G[hr_AH][:, :, None, None])
                | (swap_cost > room_tot))
        swap_gain[bad] = -np.inf

        # Replicate (busiest GPU only): expert x on h gets one more replica in donor slot q
        # (expert b, r_b >= 2), donors ranked by how little losing them hurts (light GPU,
        # light expert).
        ea_AS = ea_AHS[:, 0]
        rb_AP = np.take_along_axis(r, ph, axis=1)
        Wb_AP = np.take_along_axis(ld, ph, axis=1)
        harm = gl_AG[:, gpu_P] + Wb_AP / np.maximum(rb_AP - 1, 1)
        harm[(rb_AP < 2) | (gpu_P[None, :] == h2)] = np.inf
        # A stable sort, not argpartition: ties then pick the same donors in the same order
        # in the compiled kernel (argpartition's order among ties is unspecified).
        q_AD = np.argsort(harm, axis=1, kind="stable")[:, :D] if D < P else np.tile(np.arange(P), (A, 1))
        q_ok_AD = np.isfinite(np.take_along_axis(harm, q_AD, axis=1))
        b_AD = np.take_along_axis(ph, q_AD, axis=1)
        gq_AD = gpu_P[q_AD]
        rb = np.take_along_axis(rb_AP, q_AD, axis=1).astype(np.float64)
        Wb = np.take_along_axis(Wb_AP, q_AD, axis=1)
        wb_q = np.take_along_axis(w_AP, q_AD, axis=1)
        db = np.where(rb >= 2, Wb / np.maximum(rb - 1, 1) - wb_q, 0.0)           # [A, D] rise per b replica
        rx = np.take_along_axis(r, ea_AS, axis=1).astype(np.float64)              # [A, S]
        Wx = np.take_along_axis(ld, ea_AS, axis=1)
        dx = Wx / rx - Wx / (rx + 1)                                              # fall per x replica
        cnt_x_ASG = cnt_x_AHSG[:, 0]                                              # [A, S, G]
        cnt_b_ADG = cnt_LEG[la2, b_AD]                                            # [A, D, G]
        # New load of GPU g after the change: (gl - cnt_x * dx) + cnt_b * db, for the GPUs
        # the change touches (holding x or b) except g_q, the donor slot's GPU, priced apart.
        # The busiest touched GPU is the larger of two max-plus reductions, over GPUs holding x
        # (any b) and over GPUs holding b (any x): two [A, S, D, G] passes instead of a
        # masked [A, S, D, G] array built, gathered, scattered and reduced (same values).
        gq3 = gq_AD[:, None, :]
        y_ASG = gl_AG[:, None, :] - cnt_x_ASG * dx[:, :, None]
        cbdb_ADG = cnt_b_ADG * db[:, :, None]
        not_gq_ADG = gpu_G[None, None, :] != gq_AD[:, :, None]
        xm_ASG = np.where(cnt_x_ASG > 0, y_ASG, -np.inf)
        bm_ADG = np.where((cnt_b_ADG > 0) & not_gq_ADG, cbdb_ADG, -np.inf)
        # GPUs on axis 1 ([A, G, S, D]): the reduction then runs over whole [S, D] planes,
        # ~30% faster than over a short last axis.
        t = lambda a: np.ascontiguousarray(a.transpose(0, 2, 1))  # noqa: E731
        buf = np.add(t(xm_ASG)[:, :, :, None], t(cbdb_ADG)[:, :, None, :])
        top_ASD = buf.max(axis=1)
        np.add(t(y_ASG)[:, :, :, None], t(bm_ADG)[:, :, None, :], out=buf)
        np.maximum(top_ASD, buf.max(axis=1), out=top_ASD)
        # GPU g_q of the donor slot gains x's new replica and loses b's old one.
        cn_gx = np.take_along_axis(cnt_x_ASG, gq3, axis=2)                        # [A, S, D]
        cb_gq_AD = np.take_along_axis(cnt_b_ADG, gq_AD[:, :, None], axis=2)[:, :, 0]
        gl_gq_AD = np.take_along_axis(gl_AG, gq_AD, axis=1)
        at_g = (((gl_gq_AD[:, None, :] - cn_gx * dx[:, :, None]) + (cb_gq_AD * db)[:, None, :])
                + (Wx / (rx + 1))[:, :, None] - (wb_q + db)[:, None, :])
        rep_gain = Lh[:, None, None] - np.maximum(top_ASD, at_g)
        rep_cost = ((~np.take_along_axis(old_x_AHSG[:, 0], gq3, axis=2)).astype(np.int64)
                    - ((~old_LEG[la2, b_AD, gq_AD]) & (cb_gq_AD == 1))[:, None, :])
        rbad = (~q_ok_AD[:, None, :]) | (cn_gx > 0) | (b_AD[:, None, :] == ea_AS[:, :, None])
        rbad |= (rep_cost > room_G[gq_AD][:, None, :]) | (rep_cost > room_tot)
        rep_gain[rbad] = -np.inf

        # Best change per layer by gain per move.
        si, skey = _pick(swap_gain[:, 0], swap_cost[:, 0], need_A)
        ri, rkey = _pick(rep_gain, rep_cost, need_A)
        use_rep = rkey > skey
        best = np.maximum(skey, rkey)
        order = np.argsort(-best, kind="stable")
        order = order[np.isfinite(best[order])]
        if order.size == 0:
            break
        # Apply, best gain per move first, re-checking budgets (layers share them).
        applied = np.zeros(A, dtype=bool)
        rep_k = order[use_rep[order]]
        sw_k = order[~use_rep[order]]
        s_rp, d_rp = np.divmod(ri, D)
        s_sw, q_sw = np.divmod(si, C * S)
        # Upper bounds (1 per replication, 1 onto each GPU of a swap): if even they fit, the
        # order does not matter and every layer's change is applied at once.
        one_r, one_s = np.ones(rep_k.size, np.int64), np.ones(sw_k.size, np.int64)
        if not fits((gq_AD[rep_k, d_rp[rep_k]], gpu_P[q_AQ[sw_k, q_sw[sw_k]]], h[sw_k]), (one_r, one_s, one_s)):
            # The budget may bind: apply strictly best first over both kinds, one at a time.
            for k in order:
                kk = np.array([k])
                if use_rep[k]:
                    applied[k] = apply_reps(active[kk], h[kk] * S + s_rp[kk], q_AD[kk, d_rp[kk]])[0]
                else:
                    applied[k] = apply_swaps(active[kk], h[kk] * S + s_sw[kk], q_AQ[kk, q_sw[kk]])[0]
        else:
            if rep_k.size:
                applied[rep_k] = apply_reps(active[rep_k], h[rep_k] * S + s_rp[rep_k], q_AD[rep_k, d_rp[rep_k]])
            if sw_k.size:
                applied[sw_k] = apply_swaps(active[sw_k], h[sw_k] * S + s_sw[sw_k], q_AQ[sw_k, q_sw[sw_k]])
        if not applied.any():
            break
        active = active[applied]
    return phy


def _pick(gain, cost, need_A):
    """Per layer (axis 0), the flat index and key of the best change by gain per move: keys
    below the move's threshold are -inf, and a free change (cost <= 0) counts as a quarter
    move so it is preferred but still ranked by its gain (first maximum on ties)."""
    A = gain.shape[0]
    need = need_A.reshape((-1,) + (1,) * (gain.ndim - 1))
    key = np.where(gain >= need * np.maximum(cost, 1), gain / np.maximum(cost, 0.25), -np.inf)
    i = key.reshape(A, -1).argmax(axis=1)
    return i, key.reshape(A, -1)[np.arange(A), i]


# Schedule ----------------------------------------------------------------------------------------

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
