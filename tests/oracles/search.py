"""The budgeted search in whole-array numpy: the reference the compiled search is checked and timed against.

Legend: L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU, P = G x S slots,
A = layers still being improved, C = partner (lightest) GPUs per swap, Q = C x S partner slots,
D = donor slots, K = expert groups, N = nodes. Slot p lives on GPU p // S.

`budgeted_search` runs `eplb.migration.budgeted_search` from the same checked `SearchState`
(`prepare_search`), with every active layer's candidates priced at once per iteration:
`SearchSteps.loads` gathers what both kinds of change read, `swap_prices` and
`replication_prices` price every candidate exactly (even dispatch among replicas, the loads of
every GPU the change touches recomputed), group span included, `pick` takes each layer's best by
gain per move, and `apply_best` makes the changes the budget pays for, best gain per move
first. Ties go to the first candidate in flat order (numpy's argmax) and GPU loads are summed
slot by slot, so the kernel (eplb/migration/_search_kernel.py, _price_kernel.py: one layer and
one candidate at a time, early exits where an exact bound shows a candidate cannot win) makes
the same choices: the tests compare placements slot by slot. benchmarks/bench_kernels.py times
the two on the policy=None decision (the kernel: 2.4-4.4x faster on the Rebalancer's default budget).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from eplb.migration.search import Budget, prepare_search


def budgeted_search(load_LE, old_LP, num_gpus: int, budget: Budget, *, num_nodes=1, num_expert_groups=None,
                    donors=8, partners=8, max_iters=None) -> np.ndarray:
    """`eplb.migration.budgeted_search` in whole-array numpy, from the same checked `SearchState`."""
    state = prepare_search(load_LE, old_LP, num_gpus, budget, num_nodes=num_nodes,
                           num_expert_groups=num_expert_groups, donors=donors, partners=partners,
                           max_iters=max_iters)
    if state.num_gpus >= 2:
        SearchSteps(state).run()
    return state.phy2log_LP


def pick(gain, cost, need_A):
    """Per layer (axis 0), the flat index and key of the best change by gain per move: keys
    below the move's threshold are -inf, and a free change (cost <= 0) counts as a quarter
    move so it is preferred but still ranked by its gain (first maximum on ties)."""
    A = gain.shape[0]
    need = need_A.reshape((-1,) + (1,) * (gain.ndim - 1))
    key = np.where(gain >= need * np.maximum(cost, 1), gain / np.maximum(cost, 0.25), -np.inf)
    i = key.reshape(A, -1).argmax(axis=1)
    return i, key.reshape(A, -1)[np.arange(A), i]


def _first_smallest(v_AP, D):
    """The first D of a stable sort of each row, [A, D]: the D smallest values, ties by
    index (a partition and a sort of D, not a sort of P)."""
    A = v_AP.shape[0]
    kth = np.partition(v_AP, D - 1, axis=1)[:, D - 1:D]
    below, tie = v_AP < kth, v_AP == kth
    take = below | (tie & (np.cumsum(tie, axis=1) <= D - below.sum(axis=1, keepdims=True)))
    q_AD = np.flatnonzero(take).reshape(A, D) % v_AP.shape[1]
    return np.take_along_axis(q_AD, np.argsort(np.take_along_axis(v_AP, q_AD, axis=1), axis=1, kind="stable"), axis=1)


def _holders(mask_XYG):
    """Where mask holds, per row: GPU indices [X, Y, k] (k: the most in any row; padded with
    GPUs where it does not) and whether it holds there."""
    k = max(int(mask_XYG.sum(axis=2).max(initial=0)), 1)
    idx = np.argsort(~mask_XYG, axis=2, kind="stable")[:, :, :k]
    return idx, np.take_along_axis(mask_XYG, idx, axis=2)


class SearchSteps:
    """The search's steps on a SearchState (its arrays are updated in place)."""

    def __init__(self, st):
        self.st = st
        self.phy, self.load_LE, self.cnt_LEG, self.old_LEG = st.phy2log_LP, st.load_LE, st.cnt_LEG, st.old_LEG
        self.r_LE, self.in_G = st.r_LE, st.in_G
        self.G, self.S, self.C, self.D = st.num_gpus, st.slots_per_gpu, st.partners, st.donors
        self.cap_total, self.cap_gpu, self.min_gain_L = st.cap_total, st.cap_gpu, st.min_gain_L
        self.span, self.grp_E, self.node_G, self.gn_LKN = st.span_price, st.grp_E, st.node_G, st.gn_LKN
        self.P = self.G * self.S
        self.gpu_P = np.arange(self.P) // self.S

    # Budget ----------------------------------------------------------------------------------

    def fits(self, g_list, d_list) -> bool:
        """Can every change of a batch be paid for, in any order? (positive parts only)"""
        pos = [np.maximum(d, 0) for d in d_list]
        if sum(int(p.sum()) for p in pos) > self.cap_total - self.st.total:
            return False
        if np.isfinite(self.cap_gpu):
            need = np.zeros(self.G, dtype=np.int64)
            for g, p in zip(g_list, pos):
                np.add.at(need, g, p)
            return bool((self.in_G + need <= self.cap_gpu).all())
        return True

    def _charge(self, ok, g_list, d_list) -> None:
        """Count the moves of a batch onto in_G and the total: all of them when they fit in any
        order, else one at a time in batch order (best first), refusing (ok False) what no
        longer fits."""
        if self.fits(g_list, d_list):
            for g, d in zip(g_list, d_list):
                np.add.at(self.in_G, g, d)
                self.st.total += int(d.sum())
            return
        for k in range(ok.size):
            t = self.st.total + sum(int(d[k]) for d in d_list)
            if t > self.cap_total or any(self.in_G[g[k]] + d[k] > self.cap_gpu for g, d in zip(g_list, d_list)):
                ok[k] = False
                continue
            for g, d in zip(g_list, d_list):
                self.in_G[g[k]] += d[k]
            self.st.total = int(t)

    def _moves(self, l, x, b, g):
        """Moves onto GPU g when expert x lands there in place of b (layers l): +1 for x new to
        g in the old placement, -1 for b leaving g where it was moved (its only copy there)."""
        old_LEG, cnt_LEG = self.old_LEG, self.cnt_LEG
        return (~old_LEG[l, x, g]).astype(np.int64) - ((~old_LEG[l, b, g]) & (cnt_LEG[l, b, g] == 1))

    def apply_swaps(self, l, a_slot, q):
        """Swap slot a_slot with slot q in layers l (distinct layers); False where the budget refused."""
        phy, cnt_LEG = self.phy, self.cnt_LEG
        hh, g = self.gpu_P[a_slot], self.gpu_P[q]
        ea, eb = phy[l, a_slot], phy[l, q]
        ok = np.ones(l.size, dtype=bool)
        self._charge(ok, (g, hh), (self._moves(l, ea, eb, g), self._moves(l, eb, ea, hh)))
        l, a_slot, q, hh, g, ea, eb = (x[ok] for x in (l, a_slot, q, hh, g, ea, eb))
        phy[l, a_slot], phy[l, q] = eb, ea
        cnt_LEG[l, ea, hh] -= 1
        cnt_LEG[l, eb, hh] += 1
        cnt_LEG[l, eb, g] -= 1
        cnt_LEG[l, ea, g] += 1
        if self.span > 0:
            gn, grp, node = self.gn_LKN, self.grp_E, self.node_G
            gn[l, grp[eb], node[g]] -= 1
            gn[l, grp[ea], node[g]] += 1
            gn[l, grp[ea], node[hh]] -= 1
            gn[l, grp[eb], node[hh]] += 1
        return ok

    def apply_reps(self, l, a_slot, q):
        """Copy the expert of slot a_slot over donor slot q in layers l (distinct layers)."""
        phy, cnt_LEG, r_LE = self.phy, self.cnt_LEG, self.r_LE
        g = self.gpu_P[q]
        x, b = phy[l, a_slot], phy[l, q]
        ok = np.ones(l.size, dtype=bool)
        self._charge(ok, (g,), (self._moves(l, x, b, g),))
        l, q, g, x, b = (v[ok] for v in (l, q, g, x, b))
        phy[l, q] = x
        cnt_LEG[l, b, g] -= 1
        cnt_LEG[l, x, g] += 1
        r_LE[l, b] -= 1
        r_LE[l, x] += 1
        if self.span > 0:
            gn, grp, node = self.gn_LKN, self.grp_E, self.node_G
            gn[l, grp[b], node[g]] -= 1
            gn[l, grp[x], node[g]] += 1
        return ok

    # Prices ----------------------------------------------------------------------------------

    def loads(self, active):
        """What both kinds of change read, for the active layers: a namespace of [A, ...] arrays."""
        G, S = self.G, self.S
        A = active.size
        ph = self.phy[active]                                     # [A, P]
        ld = self.load_LE[active]                                 # [A, E]
        r = self.r_LE[active]
        ar2 = np.arange(A)[:, None]
        w_AP = (ld / r)[ar2, ph]                                  # load of each replica
        # Summed slot by slot (not .sum, whose pairwise order depends on S): the scalar
        # reference reproduces the same float64 loads exactly.
        w_AGS = w_AP.reshape(A, G, S)
        gl_AG = w_AGS[:, :, 0].copy()
        for s in range(1, S):
            gl_AG += w_AGS[:, :, s]
        srt = np.argsort(-gl_AG, axis=1, kind="stable")
        h = srt[:, 0]                                             # busiest GPU (the first of equals)
        hs_AS = h[:, None] * S + np.arange(S)                     # its slots
        ea_AS = ph[ar2, hs_AS]
        la2 = active[:, None]
        return SimpleNamespace(
            A=A, ar2=ar2, ph=ph, ld=ld, r=r, w_AP=w_AP, gl_AG=gl_AG, srt=srt, h=h, Lh=gl_AG[ar2[:, 0], h],
            hs_AS=hs_AS, ea_AS=ea_AS, room_G=self.cap_gpu - self.in_G, room_tot=self.cap_total - self.st.total, la2=la2,
            need_A=self.min_gain_L[active],
            # Counts of each busy-GPU expert on every GPU, gathered once: [A, S, G].
            cnt_x_ASG=self.cnt_LEG[la2, ea_AS], old_x_ASG=self.old_LEG[la2, ea_AS])

    def _price(self, cost, span_delta):
        """A change's price in moves: its moves, plus Budget.span_cost for each (group, node)
        pair it adds to its layer, net of those it clears (span_delta, computed only when priced)."""
        return cost + self.span * span_delta() if self.span > 0 else cost

    def swap_prices(self, v):
        """Swap: slot a on the busiest GPU h <-> slot q on one of the C lightest GPUs (heavier
        partners seldom help and would cost G / C times the work). Returns (gain, price) [A, S, Q]
        (gain -inf where refused) and the partner slots q_AQ."""
        S, C = self.S, self.C
        cnt_LEG, old_LEG, gpu_P = self.cnt_LEG, self.old_LEG, self.gpu_P
        A, ph, w_AP, gl_AG, srt, h, la2 = v.A, v.ph, v.w_AP, v.gl_AG, v.srt, v.h, v.la2
        ea_AS, cnt_x_ASG, old_x_ASG, room_G, room_tot = v.ea_AS, v.cnt_x_ASG, v.old_x_ASG, v.room_G, v.room_tot
        ar2 = v.ar2
        wa_AS = w_AP[ar2, v.hs_AS]
        light_AC = srt[:, ::-1][:, :C]
        q_AQ = (light_AC[:, :, None] * S + np.arange(S)).reshape(A, C * S)
        g_AQ = gpu_P[q_AQ]
        eb_AQ, w_AQ, gl_AQ = ph[ar2, q_AQ], w_AP[ar2, q_AQ], gl_AG[ar2, g_AQ]
        delta = wa_AS[..., None] - w_AQ[:, None, :]               # [A, S, Q] load leaving h
        # Gains are local: how far the busy GPU drops while the GPUs the change touches
        # stay below its old load. The global maximum never rises, and a layer with several
        # near-busiest GPUs still sees each step as progress.
        Lh3 = v.Lh[:, None, None]
        swap_gain = Lh3 - np.maximum(Lh3 - delta, gl_AQ[:, None, :] + delta)
        # Per partner GPU, then repeated over its S slots (S times fewer gathers).
        ar3, s3 = ar2[:, :, None], np.arange(S)[None, :, None]
        light3 = light_AC[:, None, :]
        cn_g_ea = np.repeat(cnt_x_ASG[ar3, s3, light3], S, axis=2)
        ol_g_ea = np.repeat(old_x_ASG[ar3, s3, light3], S, axis=2)
        h2 = h[:, None]
        cn_h_eb = cnt_LEG[la2, eb_AQ, h2]                         # [A, Q]
        ol_h_eb = old_LEG[la2, eb_AQ, h2]
        s2 = np.arange(S)[None, :]
        cn_h_ea, ol_h_ea = cnt_x_ASG[ar2, s2, h2], old_x_ASG[ar2, s2, h2]       # [A, S]
        cn_g_eb = cnt_LEG[la2, eb_AQ, g_AQ]                       # [A, Q]
        # Moves against the old placement: an expert landing on a GPU that did not hold it
        # costs 1; one leaving a GPU it was moved onto (its only copy there) refunds 1.
        d_g = (~ol_g_ea).astype(np.int64) - ((~old_LEG[la2, eb_AQ, g_AQ]) & (cn_g_eb == 1))[:, None, :]
        d_h = (~ol_h_eb).astype(np.int64)[:, None, :] - ((~ol_h_ea) & (cn_h_ea == 1))[..., None]
        swap_cost = d_g + d_h
        bad = (cn_g_ea > 0) | (cn_h_eb > 0)[:, None, :] | (ea_AS[..., None] == eb_AQ[:, None, :])
        bad |= (g_AQ == h2)[:, None, :]
        bad |= (d_g > room_G[g_AQ][:, None, :]) | (d_h > room_G[h][:, None, None]) | (swap_cost > room_tot)
        swap_gain[bad] = -np.inf
        return swap_gain, self._price(swap_cost, lambda: self._span_swap(v, ea_AS, eb_AQ, g_AQ)), q_AQ

    def _span_swap(self, v, ea_AS, eb_AQ, g_AQ):
        """(group, node) pairs a swap adds minus those it clears, [A, S, Q]: group A's replica
        moves from h's node to g's, group B's back."""
        grp, node, gn = self.grp_E, self.node_G, self.gn_LKN
        la3 = v.la2[:, :, None]
        A_, B_ = grp[ea_AS][..., None], grp[eb_AQ][:, None, :]
        nh, ng = node[v.h][:, None, None], node[g_AQ][:, None, :]
        new = (gn[la3, A_, ng] == 0).astype(np.int64) + (gn[la3, B_, nh] == 0)
        gone = (gn[la3, B_, ng] == 1).astype(np.int64) + (gn[la3, A_, nh] == 1)
        return np.where((A_ == B_) | (nh == ng), 0, new - gone)

    def replication_prices(self, v):
        """Replicate (busiest GPU only): expert x on h gets one more replica in donor slot q
        (expert b, r_b >= 2), donors ranked by how little losing them hurts (light GPU, light
        expert). Returns (gain, price) [A, S, D] (gain -inf where refused), q_AD and gq_AD."""
        D, P = self.D, self.P
        cnt_LEG, old_LEG, gpu_P, gpu_G = self.cnt_LEG, self.old_LEG, self.gpu_P, np.arange(self.G)
        A, ph, ld, r, w_AP, gl_AG, Lh, la2 = v.A, v.ph, v.ld, v.r, v.w_AP, v.gl_AG, v.Lh, v.la2
        ea_AS, cnt_x_ASG, old_x_ASG, room_G, room_tot = v.ea_AS, v.cnt_x_ASG, v.old_x_ASG, v.room_G, v.room_tot
        h2 = v.h[:, None]
        ar2 = v.ar2
        rb_AP, Wb_AP = r[ar2, ph], ld[ar2, ph]
        harm = gl_AG[:, gpu_P] + Wb_AP / np.maximum(rb_AP - 1, 1)
        harm[(rb_AP < 2) | (gpu_P[None, :] == h2)] = np.inf
        q_AD = _first_smallest(harm, D) if D < P else np.tile(np.arange(P), (A, 1))
        q_ok_AD = np.isfinite(harm[ar2, q_AD])
        b_AD = ph[ar2, q_AD]
        gq_AD = gpu_P[q_AD]
        rb, Wb, wb_q = rb_AP[ar2, q_AD].astype(np.float64), Wb_AP[ar2, q_AD], w_AP[ar2, q_AD]
        db = np.where(rb >= 2, Wb / np.maximum(rb - 1, 1) - wb_q, 0.0)           # [A, D] rise per b replica
        rx, Wx = r[ar2, ea_AS].astype(np.float64), ld[ar2, ea_AS]                # [A, S]
        dx = Wx / rx - Wx / (rx + 1)                                              # fall per x replica
        cnt_b_ADG = cnt_LEG[la2, b_AD]                                            # [A, D, G]
        # New load of GPU g after the change: (gl - cnt_x * dx) + cnt_b * db, for the GPUs
        # the change touches (holding x or b) except g_q, the donor slot's GPU, priced apart.
        # A GPU holding x but not b keeps y = gl - cnt_x * dx whatever the donor; one holding b
        # (other than g_q) gets y + cnt_b * db >= y. So the busiest touched GPU is the larger of
        # x's busiest y and a max over b's few GPUs, [A, S, D, k], not over all G (a candidate
        # with x on g_q is refused below, whatever this gives it).
        gq3 = gq_AD[:, None, :]
        y_ASG = gl_AG[:, None, :] - cnt_x_ASG * dx[:, :, None]
        top_AS = np.where(cnt_x_ASG > 0, y_ASG, -np.inf).max(axis=2)
        b_ADk, b_ok = _holders((cnt_b_ADG > 0) & (gpu_G[None, None, :] != gq_AD[:, :, None]))
        ar3 = ar2[:, :, None]
        cbdb_ADk = np.where(b_ok, cnt_b_ADG[ar3, np.arange(D)[None, :, None], b_ADk] * db[:, :, None], -np.inf)
        y_ASDk = y_ASG[ar3[..., None], np.arange(self.S)[None, :, None, None], b_ADk[:, None, :, :]]
        top_ASD = np.maximum(top_AS[:, :, None], (y_ASDk + cbdb_ADk[:, None, :, :]).max(axis=3))
        # GPU g_q of the donor slot gains x's new replica and loses b's old one.
        s3 = np.arange(self.S)[None, :, None]
        cn_gx = cnt_x_ASG[ar3, s3, gq3]                                           # [A, S, D]
        cb_gq_AD = cnt_b_ADG[ar2, np.arange(D)[None, :], gq_AD]
        gl_gq_AD = gl_AG[ar2, gq_AD]
        at_g = (((gl_gq_AD[:, None, :] - cn_gx * dx[:, :, None]) + (cb_gq_AD * db)[:, None, :])
                + (Wx / (rx + 1))[:, :, None] - (wb_q + db)[:, None, :])
        rep_gain = Lh[:, None, None] - np.maximum(top_ASD, at_g)
        rep_cost = ((~old_x_ASG[ar3, s3, gq3]).astype(np.int64)
                    - ((~old_LEG[la2, b_AD, gq_AD]) & (cb_gq_AD == 1))[:, None, :])
        rbad = (~q_ok_AD[:, None, :]) | (cn_gx > 0) | (b_AD[:, None, :] == ea_AS[:, :, None])
        rbad |= (rep_cost > room_G[gq_AD][:, None, :]) | (rep_cost > room_tot)
        rep_gain[rbad] = -np.inf
        return rep_gain, self._price(rep_cost, lambda: self._span_copy(v, ea_AS, b_AD, gq_AD)), q_AD, gq_AD

    def _span_copy(self, v, ea_AS, b_AD, gq_AD):
        """(group, node) pairs a replication adds minus those it clears, [A, S, D]: a replica of
        group X overwrites one of group B on the donor slot's node."""
        grp, node, gn = self.grp_E, self.node_G, self.gn_LKN
        la3 = v.la2[:, :, None]
        X, B = grp[ea_AS][..., None], grp[b_AD][:, None, :]
        ng = node[gq_AD][:, None, :]
        return np.where(X == B, 0, (gn[la3, X, ng] == 0).astype(np.int64) - (gn[la3, B, ng] == 1))

    # Changes ---------------------------------------------------------------------------------

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
            return applied
        if rep_k.size:
            applied[rep_k] = self.apply_reps(active[rep_k], h[rep_k] * S + s_rp[rep_k], q_AD[rep_k, d_rp[rep_k]])
        if sw_k.size:
            applied[sw_k] = self.apply_swaps(active[sw_k], h[sw_k] * S + s_sw[sw_k], q_AQ[sw_k, q_sw[sw_k]])
        return applied

    def run(self) -> None:
        """Iterate until no active layer has a change that passes its threshold and fits the
        budget, or the iteration limit (per layer)."""
        active = self.st.active_A
        for _ in range(self.st.iters):
            if active.size == 0:
                break
            v = self.loads(active)
            swap_gain, swap_price, q_AQ = self.swap_prices(v)
            rep_gain, rep_price, q_AD, gq_AD = self.replication_prices(v)
            si, skey = pick(swap_gain, swap_price, v.need_A)
            ri, rkey = pick(rep_gain, rep_price, v.need_A)
            use_rep = rkey > skey
            best = np.maximum(skey, rkey)
            order = np.argsort(-best, kind="stable")
            order = order[np.isfinite(best[order])]
            if order.size == 0:
                break
            applied = self.apply_best(active, order, use_rep, v.h, si, ri, q_AQ, q_AD, gq_AD)
            if not applied.any():
                break
            active = active[applied]
