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
Benchmarks import `schedule` to time the compiled schedule against it (it lives in
migration_schedule.py and is re-exported here).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from eplb.errors import EplbError
from eplb.migration import holdings
from eplb.migration.checks import check_maps
from eplb.migration.search import Budget, prepare_search
from tests.oracles.migration_schedule import schedule

__all__ = ["budgeted_search", "count_moves", "gpu_assignment", "keep_counts", "keep_slots", "schedule"]

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
    if st.num_gpus < 2:
        return st.phy2log_LP
    search = _NumpySearch(st)
    active = st.active_A
    for _ in range(st.iters):
        if active.size == 0:
            break
        v = search.layer_loads(active)
        swap_gain, swap_cost, q_AQ = search.swap_prices(v)
        rep_gain, rep_cost, q_AD, gq_AD = search.replication_prices(v)
        # Best change per layer by gain per move.
        si, skey = _pick(swap_gain[:, 0], swap_cost[:, 0], v.need_A)
        ri, rkey = _pick(rep_gain, rep_cost, v.need_A)
        use_rep = rkey > skey
        best = np.maximum(skey, rkey)
        order = np.argsort(-best, kind="stable")
        order = order[np.isfinite(best[order])]
        if order.size == 0:
            break
        applied = search.apply_best(active, order, use_rep, v.h, si, ri, q_AQ, q_AD, gq_AD)
        if not applied.any():
            break
        active = active[applied]
    return st.phy2log_LP


class _NumpySearch:
    """The numpy search on a SearchState: per iteration the loads of the active layers, the
    prices of their swaps and replications, and the changes the budget pays for."""

    H = 1                                                       # busy GPUs priced per layer

    def __init__(self, st):
        self.phy, self.load_LE, self.cnt_LEG, self.old_LEG = st.phy2log_LP, st.load_LE, st.cnt_LEG, st.old_LEG
        self.r_LE, self.in_G, self.total = st.r_LE, st.in_G, st.total
        self.G, self.S, self.C, self.D = st.num_gpus, st.slots_per_gpu, st.partners, st.donors
        self.cap_total, self.cap_gpu, self.min_gain_L = st.cap_total, st.cap_gpu, st.min_gain_L
        self.P = self.G * self.S
        self.gpu_P = np.arange(self.P) // self.S

    def fits(self, g_list, d_list):
        """Can every change of a batch be paid for, in any order? (positive parts only)"""
        pos = [np.maximum(d, 0) for d in d_list]
        if sum(int(p.sum()) for p in pos) > self.cap_total - self.total:
            return False
        if np.isfinite(self.cap_gpu):
            need = np.zeros(self.G, dtype=np.int64)
            for g, p in zip(g_list, pos):
                np.add.at(need, g, p)
            return bool((self.in_G + need <= self.cap_gpu).all())
        return True

    def apply_swaps(self, l, a_slot, q):
        """Swap slot a_slot with slot q in layers l (distinct layers); False where the budget refused."""
        phy, cnt_LEG, old_LEG, in_G, cap_total, cap_gpu = (self.phy, self.cnt_LEG, self.old_LEG, self.in_G,
                                                           self.cap_total, self.cap_gpu)
        hh, g = self.gpu_P[a_slot], self.gpu_P[q]
        ea, eb = phy[l, a_slot], phy[l, q]
        dg = (~old_LEG[l, ea, g]).astype(np.int64) - ((~old_LEG[l, eb, g]) & (cnt_LEG[l, eb, g] == 1))
        dh = (~old_LEG[l, eb, hh]).astype(np.int64) - ((~old_LEG[l, ea, hh]) & (cnt_LEG[l, ea, hh] == 1))
        ok = np.ones(l.size, dtype=bool)
        if not self.fits((g, hh), (dg, dh)):
            # The budget binds: one at a time, best first (callers pass them in that order).
            for k in range(l.size):
                t = self.total + dg[k] + dh[k]
                if t > cap_total or in_G[g[k]] + dg[k] > cap_gpu or in_G[hh[k]] + dh[k] > cap_gpu:
                    ok[k] = False
                    continue
                in_G[g[k]] += dg[k]
                in_G[hh[k]] += dh[k]
                self.total = int(t)
        else:
            np.add.at(in_G, g, dg)
            np.add.at(in_G, hh, dh)
            self.total += int(dg.sum() + dh.sum())
        l, a_slot, q, hh, g, ea, eb = (x[ok] for x in (l, a_slot, q, hh, g, ea, eb))
        phy[l, a_slot], phy[l, q] = eb, ea
        cnt_LEG[l, ea, hh] -= 1
        cnt_LEG[l, eb, hh] += 1
        cnt_LEG[l, eb, g] -= 1
        cnt_LEG[l, ea, g] += 1
        return ok

    def apply_reps(self, l, a_slot, q):
        """Copy the expert of slot a_slot over donor slot q in layers l (distinct layers)."""
        phy, cnt_LEG, old_LEG, in_G, r_LE = self.phy, self.cnt_LEG, self.old_LEG, self.in_G, self.r_LE
        g = self.gpu_P[q]
        x, b = phy[l, a_slot], phy[l, q]
        dg = (~old_LEG[l, x, g]).astype(np.int64) - ((~old_LEG[l, b, g]) & (cnt_LEG[l, b, g] == 1))
        ok = np.ones(l.size, dtype=bool)
        if not self.fits((g,), (dg,)):
            for k in range(l.size):
                t = self.total + dg[k]
                if t > self.cap_total or in_G[g[k]] + dg[k] > self.cap_gpu:
                    ok[k] = False
                    continue
                in_G[g[k]] += dg[k]
                self.total = int(t)
        else:
            np.add.at(in_G, g, dg)
            self.total += int(dg.sum())
        l, q, g, x, b = (v[ok] for v in (l, q, g, x, b))
        phy[l, q] = x
        cnt_LEG[l, b, g] -= 1
        cnt_LEG[l, x, g] += 1
        r_LE[l, b] -= 1
        r_LE[l, x] += 1
        return ok

    def layer_loads(self, active):
        """What both kinds of change read, for the active layers: a namespace of [A, ...] arrays."""
        G, S = self.G, self.S
        A = active.size
        ar = np.arange(A)
        ph = self.phy[active]                                     # [A, P]
        ld = self.load_LE[active]                                 # [A, E]
        r = self.r_LE[active]
        w_AP = np.take_along_axis(ld / r, ph, axis=1)             # load of each replica
        # Summed slot by slot (not .sum, whose pairwise order depends on S) so the compiled
        # kernel can reproduce the same float64 loads exactly.
        w_AGS = w_AP.reshape(A, G, S)
        gl_AG = w_AGS[:, :, 0].copy()
        for s in range(1, S):
            gl_AG += w_AGS[:, :, s]
        srt = np.argsort(-gl_AG, axis=1, kind="stable")
        h = srt[:, 0]                                             # busiest GPU
        hr_AH = srt[:, :self.H]
        hs_AHS = hr_AH[:, :, None] * S + np.arange(S)             # slots of the busy GPUs
        ea_AHS = np.take_along_axis(ph, hs_AHS.reshape(A, self.H * S), axis=1).reshape(A, self.H, S)
        la3 = active[:, None, None]
        return SimpleNamespace(
            A=A, ph=ph, ld=ld, r=r, w_AP=w_AP, gl_AG=gl_AG, srt=srt, h=h, Lh=gl_AG[ar, h], hr_AH=hr_AH,
            hs_AHS=hs_AHS, ea_AHS=ea_AHS, room_G=self.cap_gpu - self.in_G, room_tot=self.cap_total - self.total,
            la2=active[:, None], la3=la3, need_A=self.min_gain_L[active],
            # Counts of each busy-GPU expert on every GPU, gathered once: [A, H, S, G].
            cnt_x_AHSG=self.cnt_LEG[la3, ea_AHS], old_x_AHSG=self.old_LEG[la3, ea_AHS])

    def swap_prices(self, v):
        """Swap: slot a on the busiest GPU (axis H, one row) <-> slot q on one of the C lightest
        GPUs (heavier partners seldom help and would cost G / C times the work). Returns
        (gain, cost) [A, H, S, Q] (gain -inf where refused) and the partner slots q_AQ."""
        S, C, H = self.S, self.C, self.H
        cnt_LEG, old_LEG, gpu_P = self.cnt_LEG, self.old_LEG, self.gpu_P
        A, ph, w_AP, gl_AG, srt, hr_AH = v.A, v.ph, v.w_AP, v.gl_AG, v.srt, v.hr_AH
        ea_AHS, cnt_x_AHSG, old_x_AHSG, la2, la3 = v.ea_AHS, v.cnt_x_AHSG, v.old_x_AHSG, v.la2, v.la3
        room_G, room_tot = v.room_G, v.room_tot
        Lr_AH = np.take_along_axis(gl_AG, hr_AH, axis=1)
        wa_AHS = np.take_along_axis(w_AP, v.hs_AHS.reshape(A, H * S), axis=1).reshape(A, H, S)
        light_AC = srt[:, ::-1][:, :C]
        q_AQ = (light_AC[:, :, None] * S + np.arange(S)).reshape(A, C * S)
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
        return swap_gain, swap_cost, q_AQ

    def replication_prices(self, v):
        """Replicate (busiest GPU only): expert x on h gets one more replica in donor slot q
        (expert b, r_b >= 2), donors ranked by how little losing them hurts (light GPU, light
        expert). Returns (gain, cost) [A, S, D] (gain -inf where refused), q_AD and gq_AD."""
        D, P = self.D, self.P
        cnt_LEG, old_LEG, gpu_P, gpu_G = self.cnt_LEG, self.old_LEG, self.gpu_P, np.arange(self.G)
        A, ph, ld, r, w_AP, gl_AG, Lh, la2 = v.A, v.ph, v.ld, v.r, v.w_AP, v.gl_AG, v.Lh, v.la2
        ea_AHS, cnt_x_AHSG, old_x_AHSG, room_G, room_tot = v.ea_AHS, v.cnt_x_AHSG, v.old_x_AHSG, v.room_G, v.room_tot
        h2 = v.h[:, None]
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
        # faster than over a short last axis.
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
        return rep_gain, rep_cost, q_AD, gq_AD

    def apply_best(self, active, order, use_rep, h, si, ri, q_AQ, q_AD, gq_AD):
        """Apply the layers' changes in `order` (best gain per move first), re-checking budgets
        (layers share them); returns which were applied, bool [A]."""
        S, C, D, gpu_P = self.S, self.C, self.D, self.gpu_P
        applied = np.zeros(active.size, dtype=bool)
        rep_k = order[use_rep[order]]
        sw_k = order[~use_rep[order]]
        s_rp, d_rp = np.divmod(ri, D)
        s_sw, q_sw = np.divmod(si, C * S)
        # Upper bounds (1 per replication, 1 onto each GPU of a swap): if even they fit, the
        # order does not matter and every layer's change is applied at once.
        one_r, one_s = np.ones(rep_k.size, np.int64), np.ones(sw_k.size, np.int64)
        if not self.fits((gq_AD[rep_k, d_rp[rep_k]], gpu_P[q_AQ[sw_k, q_sw[sw_k]]], h[sw_k]), (one_r, one_s, one_s)):
            # The budget may bind: apply strictly best first over both kinds, one at a time.
            for k in order:
                kk = np.array([k])
                if use_rep[k]:
                    applied[k] = self.apply_reps(active[kk], h[kk] * S + s_rp[kk], q_AD[kk, d_rp[kk]])[0]
                else:
                    applied[k] = self.apply_swaps(active[kk], h[kk] * S + s_sw[kk], q_AQ[kk, q_sw[kk]])[0]
        else:
            if rep_k.size:
                applied[rep_k] = self.apply_reps(active[rep_k], h[rep_k] * S + s_rp[rep_k], q_AD[rep_k, d_rp[rep_k]])
            if sw_k.size:
                applied[sw_k] = self.apply_swaps(active[sw_k], h[sw_k] * S + s_sw[sw_k], q_AQ[sw_k, q_sw[sw_k]])
        return applied


def _pick(gain, cost, need_A):
    """Per layer (axis 0), the flat index and key of the best change by gain per move: keys
    below the move's threshold are -inf, and a free change (cost <= 0) counts as a quarter
    move so it is preferred but still ranked by its gain (first maximum on ties)."""
    A = gain.shape[0]
    need = need_A.reshape((-1,) + (1,) * (gain.ndim - 1))
    key = np.where(gain >= need * np.maximum(cost, 1), gain / np.maximum(cost, 0.25), -np.inf)
    i = key.reshape(A, -1).argmax(axis=1)
    return i, key.reshape(A, -1)[np.arange(A), i]
