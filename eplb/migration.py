"""Migration: move a served placement to a new one cheaply (few copies) and safely (no gaps).

Legend: L = MoE layers, E = logical experts, G = GPUs (ranks), N = nodes, S = slots per GPU,
P = G x S physical slots, M = transfers, R = rounds, A = layers still being improved,
D = donor slots considered per layer. Slot p lives on GPU p // S.

Three parts:
1. Counting. A *move* is a replica copied onto a GPU that did not hold that expert before
   (in that layer); reshuffling slots inside a GPU is free. `count_moves` counts them.
2. Migration-aware planning. `relabel` renames the GPUs (and nodes) of a new plan so that it
   keeps as many of the old replicas as possible (an assignment problem per layer, solved
   with scipy's linear_sum_assignment), then keeps every replica that stays on its GPU in
   its old slot. `budgeted_search` starts from the old placement and applies the replica
   changes that lower each layer's busiest GPU most per move, until a move budget (total,
   per GPU) is spent or no change buys at least `move_cost`. `migrate` combines the two.
3. Scheduling. `schedule` orders the copies into rounds in which every rank sends at most
   one and receives at most one expert, such that every logical expert keeps at least one
   complete replica serving tokens at every moment; `MigrationPlan.serving(k)` gives the
   placement to serve with during round k (slots being written get dispatch weight 0).
   Cycles (two GPUs exchanging the only replicas of two experts) are broken by *staging*:
   one expert is first copied into a slot whose own expert has another complete replica
   (one exists whenever P > E), and that slot is restored afterwards; see `schedule`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.errors import EplbError

CHECKPOINT = -1
"""Source rank of a transfer that reloads an expert from the checkpoint (no replica survived)."""


# 1. Counting ------------------------------------------------------------------------------------

def holdings(phy_LP: np.ndarray, gpus: int, num_experts: int) -> np.ndarray:
    """Replicas of each expert on each GPU, int64 [L, G, E]. Entries < 0 in phy_LP (empty) are skipped."""
    phy_LP = np.asarray(phy_LP)
    L, P = phy_LP.shape
    S = P // gpus
    gpu_P = np.arange(P) // S
    flat = (np.arange(L)[:, None] * gpus + gpu_P[None, :]) * num_experts + phy_LP
    flat = flat[phy_LP >= 0]
    return np.bincount(flat, minlength=L * gpus * num_experts).reshape(L, gpus, num_experts)


def count_moves(old_LP: np.ndarray, new_LP: np.ndarray, gpus: int, num_experts: int) -> np.ndarray:
    """Moves onto each GPU, int64 [L, G]: experts the GPU holds in new_LP but not in old_LP."""
    old = holdings(old_LP, gpus, num_experts) > 0
    new = holdings(new_LP, gpus, num_experts) > 0
    return (new & ~old).sum(axis=2)


# 2a. Relabelling --------------------------------------------------------------------------------

def _gpu_assignment(keep_LGG: np.ndarray, nodes: int) -> np.ndarray:
    """For each layer, which new GPU goes to each old GPU position, int64 [L, G].

    keep_LGG[l, a, b]: experts new GPU a would keep if it became old GPU b. With several
    nodes a node's GPUs move as a whole (node-aware planners packed them together): first
    the best GPU matching for every (new node, old node) pair, then the best node matching.
    """
    from scipy.optimize import linear_sum_assignment

    L, G, _ = keep_LGG.shape
    out = np.empty((L, G), dtype=np.int64)
    if nodes == 1:
        for l in range(L):
            rows, cols = linear_sum_assignment(keep_LGG[l], maximize=True)
            out[l, cols] = rows
        return out
    n = G // nodes
    for l in range(L):
        node_keep = np.empty((nodes, nodes))
        inner = {}
        for a in range(nodes):
            for b in range(nodes):
                block = keep_LGG[l, a * n:(a + 1) * n, b * n:(b + 1) * n]
                rows, cols = linear_sum_assignment(block, maximize=True)
                node_keep[a, b] = block[rows, cols].sum()
                inner[a, b] = (rows, cols)
        na, nb = linear_sum_assignment(node_keep, maximize=True)
        for a, b in zip(na, nb):
            rows, cols = inner[a, b]
            out[l, b * n + cols] = a * n + rows
    return out


def relabel(old_LP: np.ndarray, new_LP: np.ndarray, gpus: int, num_experts: int,
            nodes: int = 1) -> np.ndarray:
    """Slot permutation perm_LP that makes new_LP[l, perm_LP[l]] keep the most old replicas.

    The GPUs of one layer are interchangeable as wholes (and nodes, as wholes of GPUs), so a
    new plan loses nothing by renaming them; the renaming that keeps the most (GPU, expert)
    pairs of old_LP is an assignment problem. Inside a GPU, an expert it already held goes
    back to the slot it occupied, so a kept replica is not even copied locally.
    """
    old_LP = np.asarray(old_LP)
    new_LP = np.asarray(new_LP)
    L, P = new_LP.shape
    G, S = gpus, P // gpus
    old_h = (holdings(old_LP, G, num_experts) > 0).astype(np.float32)
    new_h = (holdings(new_LP, G, num_experts) > 0).astype(np.float32)
    keep_LGG = new_h @ old_h.transpose(0, 2, 1)
    gsrc_LG = _gpu_assignment(keep_LGG, nodes)             # new GPU placed at each old GPU position
    # Slots of new GPU gsrc[l, b] placed on GPU b, still in their own order.
    base_LP = (gsrc_LG[:, :, None] * S + np.arange(S)[None, None, :]).reshape(L, P)
    moved_LP = np.take_along_axis(new_LP, base_LP, axis=1)

    # Inside each GPU: match the k-th copy of expert e in the new slots to the k-th copy of e
    # in the old slots (keys e * S + k are unique within a GPU), keep matched ones in place.
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
    return np.take_along_axis(base_LP, within_LP, axis=1)


# 2b. Budgeted local search ----------------------------------------------------------------------

@dataclass(frozen=True)
class Budget:
    """How much migration a plan may cause."""

    max_moves: int | None = None
    """Moves in total over all layers (None: unlimited)."""
    max_moves_per_gpu: int | None = None
    """Moves onto any one GPU, summed over layers (None: unlimited). Bounds the rounds."""
    move_cost: float = 0.0
    """A move is made only if it lowers its layer's busiest-GPU load by at least this
    fraction of the layer's mean GPU load (0.002 = 0.2% per copied expert). With bytes per
    expert B, this is a price of move_cost / B of balance per byte."""

    def __post_init__(self) -> None:
        for name in ("max_moves", "max_moves_per_gpu"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or int(v) != v or v < 0):
                raise EplbError(f"{name} must be a whole number >= 0 or None, got {v!r}")
        if not np.isfinite(self.move_cost) or self.move_cost < 0:
            raise EplbError(f"move_cost must be a finite number >= 0, got {self.move_cost!r}")

    @property
    def limited(self) -> bool:
        return self.max_moves is not None or self.max_moves_per_gpu is not None or self.move_cost > 0


def budgeted_search(load_LE: np.ndarray, old_LP: np.ndarray, gpus: int, budget: Budget,
                    *, donors: int = 16, partners: int = 8, max_iters: int | None = None) -> np.ndarray:
    """Start from old_LP and apply the best replica changes per move until the budget is spent.

    Per layer and iteration, two kinds of change are priced exactly (even dispatch among
    replicas, loads of every GPU recomputed):
    - swap: exchange a replica on the busiest GPU with one on another GPU (replica counts
      unchanged; up to 2 moves, fewer if an expert returns to a GPU that held it);
    - replicate: overwrite a donor slot (an expert with >= 2 replicas, among the `donors`
      cheapest per layer) with another replica of an expert on the busiest GPU (1 move).
    Every active layer takes its change with the best gain per move in each iteration; when
    the budget cannot pay for all, the best gains per move over all layers go first.
    old_LP may lack experts (failed ranks): call `restore_missing` first. Returns phy2log_LP.
    """
    load_LE = np.asarray(load_LE, dtype=np.float64)
    phy = np.array(old_LP, dtype=np.int64, copy=True)
    L, P = phy.shape
    E = load_LE.shape[1]
    G, S = gpus, P // gpus
    gpu_P = np.arange(P) // S
    # [L, E, G] layout: the GPUs of one (layer, expert) are contiguous, so the gathers below
    # read short rows instead of scattered bytes.
    old_LEG = (holdings(old_LP, G, E) > 0).transpose(0, 2, 1).copy()
    cnt_LEG = holdings(phy, G, E).transpose(0, 2, 1).astype(np.int16)
    r_LE = cnt_LEG.sum(axis=2).astype(np.int64)
    if (r_LE == 0).any():
        l, e = np.argwhere(r_LE == 0)[0]
        raise EplbError(f"expert {e} has no replica in layer index {l}: restore it before searching")
    in_G = ((cnt_LEG > 0) & ~old_LEG).sum(axis=(0, 1))          # moves onto each GPU so far
    total = int(in_G.sum())
    cap_total = np.inf if budget.max_moves is None else budget.max_moves
    cap_gpu = np.inf if budget.max_moves_per_gpu is None else budget.max_moves_per_gpu
    mean_L = load_LE.sum(axis=1) / G
    # Gains below 1e-9 of the layer's mean load are rounding noise, not progress.
    min_gain_L = np.maximum(budget.move_cost, 1e-9) * mean_L
    active = np.flatnonzero(mean_L > 0)
    D = min(donors, P)
    C = min(partners, G - 1)
    iters = max_iters if max_iters is not None else 4 * P
    if G < 2:
        return phy
    for _ in range(iters):
        if active.size == 0:
            break
        A = active.size
        ar = np.arange(A)
        ph = phy[active]                                          # [A, P]
        ld = load_LE[active]                                      # [A, E]
        r = r_LE[active]
        w_AP = np.take_along_axis(ld / r, ph, axis=1)             # load of each replica
        gl_AG = w_AP.reshape(A, G, S).sum(axis=2)
        srt = np.argsort(-gl_AG, axis=1)
        h = srt[:, 0]                                             # busiest GPU
        Lh = gl_AG[ar, h]
        top2 = gl_AG[ar, srt[:, 1]]
        top3 = gl_AG[ar, srt[:, 2]] if G > 2 else np.zeros(A)
        hs_AS = h[:, None] * S + np.arange(S)[None, :]            # slots of the busiest GPU
        ea_AS = np.take_along_axis(ph, hs_AS, axis=1)
        wa_AS = np.take_along_axis(w_AP, hs_AS, axis=1)
        room_G = cap_gpu - in_G
        room_tot = cap_total - total
        la2, la3 = active[:, None], active[:, None, None]
        h2 = h[:, None]

        # Swap: slot a on h <-> slot q on one of the C lightest GPUs (heavier partners
        # seldom help and would cost G / C times the work).
        light_AC = srt[:, ::-1][:, :C]
        q_AQ = (light_AC[:, :, None] * S + np.arange(S)[None, None, :]).reshape(A, C * S)
        g_AQ = gpu_P[q_AQ]
        eb_AQ = np.take_along_axis(ph, q_AQ, axis=1)
        w_AQ = np.take_along_axis(w_AP, q_AQ, axis=1)
        gl_AQ = np.take_along_axis(gl_AG, g_AQ, axis=1)
        delta = wa_AS[:, :, None] - w_AQ[:, None, :]             # [A, S, Q] load leaving h
        others = np.where(g_AQ == srt[:, 1:2], top3[:, None], top2[:, None])[:, None, :]
        swap_gain = Lh[:, None, None] - np.maximum(
            np.maximum(Lh[:, None, None] - delta, gl_AQ[:, None, :] + delta), others)
        x3, g3 = ea_AS[:, :, None], g_AQ[:, None, :]
        cn_g_ea = cnt_LEG[la3, x3, g3]                            # [A, S, Q]
        cn_h_eb = cnt_LEG[la2, eb_AQ, h2][:, None, :]             # [A, 1, Q]
        cn_h_ea = cnt_LEG[la2, ea_AS, h2]                         # [A, S]
        cn_g_eb = cnt_LEG[la2, eb_AQ, g_AQ]                       # [A, Q]
        # Moves against the old placement: an expert landing on a GPU that did not hold it
        # costs 1; one leaving a GPU it was moved onto (its only copy there) refunds 1.
        d_g = ((~old_LEG[la3, x3, g3]).astype(np.int64)
               - ((~old_LEG[la2, eb_AQ, g_AQ]) & (cn_g_eb == 1))[:, None, :])
        d_h = ((~old_LEG[la2, eb_AQ, h2]).astype(np.int64)[:, None, :]
               - ((~old_LEG[la2, ea_AS, h2]) & (cn_h_ea == 1))[:, :, None])
        swap_cost = d_g + d_h
        bad = (cn_g_ea > 0) | (cn_h_eb > 0) | (x3 == eb_AQ[:, None, :])
        bad |= (d_g > room_G[g_AQ][:, None, :]) | (d_h > room_G[h][:, None, None]) | (swap_cost > room_tot)
        swap_gain[bad] = -np.inf

        # Replicate: expert x on h gets one more replica in donor slot q (expert b, r_b >= 2),
        # donors ranked by how little losing them hurts (light GPU, light expert).
        rb_AP = np.take_along_axis(r, ph, axis=1)
        Wb_AP = np.take_along_axis(ld, ph, axis=1)
        harm = gl_AG[:, gpu_P] + Wb_AP / np.maximum(rb_AP - 1, 1)
        harm[(rb_AP < 2) | (gpu_P[None, :] == h2)] = np.inf
        q_AD = np.argpartition(harm, D - 1, axis=1)[:, :D] if D < P else np.tile(np.arange(P), (A, 1))
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
        cnt_x_ASG = cnt_LEG[la2, ea_AS]                                           # [A, S, G]
        cnt_b_ADG = cnt_LEG[la2, b_AD]                                            # [A, D, G]
        new_ASDG = ((gl_AG[:, None, :] - cnt_x_ASG * dx[:, :, None])[:, :, None, :]
                    + (cnt_b_ADG * db[:, :, None])[:, None, :, :])
        # GPU g of the donor slot also gains x's new replica and loses b's old one; the
        # busiest of the other GPUs is taken with g masked out.
        ia, isx, idd = np.ix_(ar, np.arange(S), np.arange(D))
        gq3 = gq_AD[:, None, :]
        at_g = new_ASDG[ia, isx, idd, gq3] + (Wx / (rx + 1))[:, :, None] - (wb_q + db)[:, None, :]
        new_ASDG[ia, isx, idd, gq3] = -np.inf
        rep_gain = Lh[:, None, None] - np.maximum(new_ASDG.max(axis=3), at_g)
        cn_gx = cnt_x_ASG[ia, isx, gq3]                                           # [A, S, D]
        rep_cost = ((~old_LEG[la3, x3, gq3]).astype(np.int64)
                    - ((~old_LEG[la2, b_AD, gq_AD]) & (cnt_b_ADG[ia[:, :, 0], idd[:, 0], gq_AD] == 1))[:, None, :])
        rbad = (~q_ok_AD[:, None, :]) | (cn_gx > 0) | (b_AD[:, None, :] == x3)
        rbad |= (rep_cost > room_G[gq_AD][:, None, :]) | (rep_cost > room_tot)
        rep_gain[rbad] = -np.inf

        # Best change per layer by gain per move; a free change (cost <= 0) counts as a
        # quarter move so it is preferred but still ranked by its gain.
        def pick(gain, cost):
            need = min_gain_L[active].reshape((-1,) + (1,) * (gain.ndim - 1))
            key = np.where(gain >= need * np.maximum(cost, 1), gain / np.maximum(cost, 0.25), -np.inf)
            i = key.reshape(A, -1).argmax(axis=1)
            return i, key.reshape(A, -1)[ar, i]
        si, skey = pick(swap_gain, swap_cost)
        ri, rkey = pick(rep_gain, rep_cost)
        use_rep = rkey > skey
        best = np.maximum(skey, rkey)
        order = np.argsort(-best)
        order = order[np.isfinite(best[order])]
        if order.size == 0:
            break
        s_sw, q_sw = np.divmod(si, C * S)
        s_rp, d_rp = np.divmod(ri, D)
        # Apply, best gain per move first, re-checking budgets (layers share them).
        applied = []
        for k in order:
            l, hh = active[k], h[k]
            if use_rep[k]:
                a_slot, q = hh * S + s_rp[k], q_AD[k, d_rp[k]]
                x, b, g = phy[l, a_slot], phy[l, q], gpu_P[q]
                dg = int(not old_LEG[l, x, g]) - int(not old_LEG[l, b, g] and cnt_LEG[l, b, g] == 1)
                if total + dg > cap_total or in_G[g] + dg > cap_gpu:
                    continue
                phy[l, q] = x
                cnt_LEG[l, b, g] -= 1
                cnt_LEG[l, x, g] += 1
                r_LE[l, b] -= 1
                r_LE[l, x] += 1
                in_G[g] += dg
                total += dg
            else:
                a_slot, q = hh * S + s_sw[k], q_AQ[k, q_sw[k]]
                g = gpu_P[q]
                ea, eb = phy[l, a_slot], phy[l, q]
                dg = int(not old_LEG[l, ea, g]) - int(not old_LEG[l, eb, g] and cnt_LEG[l, eb, g] == 1)
                dh = int(not old_LEG[l, eb, hh]) - int(not old_LEG[l, ea, hh] and cnt_LEG[l, ea, hh] == 1)
                if total + dg + dh > cap_total or in_G[g] + dg > cap_gpu or in_G[hh] + dh > cap_gpu:
                    continue
                phy[l, a_slot], phy[l, q] = eb, ea
                cnt_LEG[l, ea, hh] -= 1
                cnt_LEG[l, eb, hh] += 1
                cnt_LEG[l, eb, g] -= 1
                cnt_LEG[l, ea, g] += 1
                in_G[g] += dg
                in_G[hh] += dh
                total += dg + dh
            applied.append(l)
        if not applied:
            break
        active = np.asarray(sorted(applied), dtype=np.int64)
    return phy


def restore_missing(load_LE: np.ndarray, phy_LP: np.ndarray, gpus: int) -> np.ndarray:
    """Give every expert without a replica (-1 slots or experts absent) one, heaviest first.

    Empty slots (-1) are used first; then the slot of a replica whose expert has the most
    replicas and the lowest load per replica, on the least-loaded GPU that does not hold the
    expert. Returns a copy of phy_LP with no expert missing.
    """
    load_LE = np.asarray(load_LE, dtype=np.float64)
    phy = np.array(phy_LP, dtype=np.int64, copy=True)
    L, P = phy.shape
    E = load_LE.shape[1]
    G, S = gpus, P // gpus
    for l in range(L):
        row = phy[l]
        present = np.zeros(E, dtype=np.int64)
        np.add.at(present, row[row >= 0], 1)
        missing = np.flatnonzero(present == 0)
        if missing.size == 0 and (row >= 0).all():
            continue
        for e in missing[np.argsort(-load_LE[l, missing], kind="stable")]:
            r = np.maximum(present, 1)
            w = np.where(row >= 0, load_LE[l, np.maximum(row, 0)] / r[np.maximum(row, 0)], 0.0)
            gl = w.reshape(G, S).sum(axis=1)
            holds = np.zeros(G, bool)
            holds[np.arange(P)[row == e] // S] = True
            empty = row < 0
            donor = (row >= 0) & (present[np.maximum(row, 0)] >= 2)
            ok = (empty | donor) & ~holds[np.arange(P) // S]
            if not ok.any():
                ok = empty | donor
            if not ok.any():
                raise EplbError(f"{P} slots cannot hold all {E} experts in layer index {l}")
            # Prefer empty slots, then light GPUs, then cheap donors.
            score = np.where(empty, -1e300, gl[np.arange(P) // S] + np.where(donor, w, 0))
            q = int(np.argmin(np.where(ok, score, np.inf)))
            if row[q] >= 0:
                present[row[q]] -= 1
            row[q] = e
            present[e] += 1
        # Leftover empty slots take extra replicas of the heaviest experts per replica.
        for q in np.flatnonzero(row < 0):
            held = set(row[(np.arange(P) // S) == q // S].tolist())
            per = load_LE[l] / np.maximum(present, 1)
            per[list(h for h in held if h >= 0)] = -1.0
            e = int(np.argmax(per))
            row[q] = e
            present[e] += 1
    return phy


def migrate(load_LE: np.ndarray, old_LP: np.ndarray, target_LP: np.ndarray, gpus: int,
            nodes: int = 1, budget: Budget | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
    """Turn a from-scratch plan into one that fits the old placement and the budget.

    Returns (phy2log_LP, perm_LP, info). perm_LP maps each slot of the result to a slot of
    target_LP (so the planner's dispatch weights can follow), or is None when the budgeted
    search replaced the target. info holds the move counts of each candidate.
    """
    load_LE = np.asarray(load_LE, dtype=np.float64)
    old_LP = np.asarray(old_LP, dtype=np.int64)
    target_LP = np.asarray(target_LP, dtype=np.int64)
    E = load_LE.shape[1]
    budget = budget or Budget()
    perm = relabel(old_LP, target_LP, gpus, E, nodes)
    relabeled = np.take_along_axis(target_LP, perm, axis=1)
    moves_scratch = int(count_moves(old_LP, target_LP, gpus, E).sum())
    moves_rel_LG = count_moves(old_LP, relabeled, gpus, E)
    info = {"moves_from_scratch": moves_scratch, "moves_relabeled": int(moves_rel_LG.sum())}
    if not budget.limited:
        info["method"] = "relabel"
        return relabeled, perm, info
    start = restore_missing(load_LE, old_LP, gpus) if (old_LP < 0).any() or (
        holdings(old_LP, gpus, E).sum(axis=1) == 0).any() else old_LP
    searched = budgeted_search(load_LE, start, gpus, budget)
    # The relabelled target wins if the budget can pay for it and it balances at least as well.
    fits = ((budget.max_moves is None or moves_rel_LG.sum() <= budget.max_moves)
            and (budget.max_moves_per_gpu is None or moves_rel_LG.sum(axis=0).max() <= budget.max_moves_per_gpu)
            and budget.move_cost == 0)
    if fits and max_load(load_LE, relabeled, gpus).sum() <= max_load(load_LE, searched, gpus).sum():
        info["method"] = "relabel"
        return relabeled, perm, info
    info["method"] = "budgeted_search"
    return searched, None, info


def max_load(load_LE: np.ndarray, phy_LP: np.ndarray, gpus: int) -> np.ndarray:
    """Busiest GPU's load per layer under even dispatch, [L] (slots < 0 hold nothing)."""
    load_LE = np.asarray(load_LE, dtype=np.float64)
    L, P = phy_LP.shape
    E = load_LE.shape[1]
    valid = phy_LP >= 0
    r = np.zeros((L, E))
    np.add.at(r, (np.nonzero(valid)[0], phy_LP[valid]), 1)
    e = np.maximum(phy_LP, 0)
    w = np.where(valid, np.take_along_axis(load_LE / np.maximum(r, 1), e, axis=1), 0.0)
    return w.reshape(L, gpus, P // gpus).sum(axis=2).max(axis=1)
