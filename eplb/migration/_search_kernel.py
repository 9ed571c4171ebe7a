"""Compiled budgeted search (numba): the loop of `eplb.migration.budgeted_search`.

Legend: L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU, P = G x S slots,
A = layers still being improved, C = partner (lightest) GPUs per swap, D = donor slots,
K = expert groups, N = nodes.

- `holdings_LEG`: the replica counts the search starts from, [L, E, G];
- `search`: every iteration prices each active layer's best change (`_price_kernel`) and
  applies the changes the budget can pay for, best gain per move first. Without a move cap
  the layers share nothing and each runs all its iterations in turn (`_search_uncapped`);
  with one, they take turns iteration by iteration (`_price_active`, `_apply_in_order`).
The numpy reference (tests/oracles/search.py) makes the same choices from the same state,
group span included (the tests compare placements slot by slot). Every kernel trusts its
input (`eplb.migration.search` checks it) and releases the GIL, so a serving thread keeps
running while a side thread plans.
"""

from __future__ import annotations

import numpy as np

from eplb.core.jit import kernel
from eplb.migration._price_kernel import price_layer


@kernel(inline=True, error_model="numpy")
def _move_deltas(l, a, q, S, phy, cnt_LEG, old_LEG):
    """Moves a change of layer l adds onto slot q's GPU (dg) and, for a swap, onto slot a's GPU
    (dh): +1 for an expert landing on a GPU that did not hold it in the old placement, -1 for
    one leaving a GPU it was moved onto (its only copy there)."""
    g = q // S
    hh = a // S
    ea = phy[l, a]
    eb = phy[l, q]
    dg = (0 if old_LEG[l, ea, g] else 1) - (1 if ((not old_LEG[l, eb, g]) and cnt_LEG[l, eb, g] == 1) else 0)
    dh = (0 if old_LEG[l, eb, hh] else 1) - (1 if ((not old_LEG[l, ea, hh]) and cnt_LEG[l, ea, hh] == 1) else 0)
    return dg, dh


@kernel(error_model="numpy")
def _apply(l, replicate, a, q, phy, r_LE, cnt_LEG, old_LEG, in_G, S, span, grp_E, node_G, gn_LKN):
    """Apply one change to layer l (copy slot a's expert over slot q, or swap a and q); returns its moves."""
    g = q // S
    hh = a // S
    ea = phy[l, a]
    eb = phy[l, q]
    dg, dh = _move_deltas(l, a, q, S, phy, cnt_LEG, old_LEG)
    if span > 0.0:
        gn_LKN[l, grp_E[eb], node_G[g]] -= 1
        gn_LKN[l, grp_E[ea], node_G[g]] += 1
        if not replicate:
            gn_LKN[l, grp_E[ea], node_G[hh]] -= 1
            gn_LKN[l, grp_E[eb], node_G[hh]] += 1
    if replicate:
        in_G[g] += dg
        phy[l, q] = ea
        cnt_LEG[l, eb, g] -= 1
        cnt_LEG[l, ea, g] += 1
        r_LE[l, eb] -= 1
        r_LE[l, ea] += 1
        return dg
    in_G[g] += dg
    in_G[hh] += dh
    phy[l, a] = eb
    phy[l, q] = ea
    cnt_LEG[l, ea, hh] -= 1
    cnt_LEG[l, eb, hh] += 1
    cnt_LEG[l, eb, g] -= 1
    cnt_LEG[l, ea, g] += 1
    return dg + dh


@kernel(inline=True, error_model="numpy")
def _best_change(l, phy, load_LE, r_LE, cnt_LEG, old_LEG, room_G, room_tot, need, G, S, C, D, fw, iw,
                 span, grp_E, node_G, gn_LKN):
    """Layer l's best change: (key, replicate?, slot a on the busiest GPU, slot q it goes to);
    key -inf when no change passes the threshold."""
    skey, s_i, rkey, r_i, h, light, q_D = price_layer(
        l, phy, load_LE, r_LE, cnt_LEG, old_LEG, room_G, room_tot, need, G, S, C, D, fw, iw,
        span, grp_E, node_G, gn_LKN[l])
    if rkey > skey:
        return rkey, True, h * S + r_i // D, q_D[r_i % D]
    qi = s_i % (C * S)
    return skey, False, h * S + s_i // (C * S), light[qi // S] * S + qi % S


@kernel(inline=True, error_model="numpy")
def _search_uncapped(load_LE, phy, r_LE, cnt_LEG, old_LEG, in_G, total, min_gain_L, active, G, S, C, D, iters,
                     span, grp_E, node_G, gn_LKN, fw, iw):
    """No move cap: no change is ever refused and layers share nothing, so each layer runs all
    its iterations in turn (the same changes as iteration by iteration, and its arrays stay in
    cache). The iteration limit still counts per layer. Returns the move total."""
    room_G = np.full(G, np.inf)
    for ai in range(active.size):
        l = active[ai]
        for _ in range(iters):
            key, replicate, a, q = _best_change(
                l, phy, load_LE, r_LE, cnt_LEG, old_LEG, room_G, np.inf, min_gain_L[l], G, S, C, D, fw, iw,
                span, grp_E, node_G, gn_LKN)
            if not np.isfinite(key):
                break
            total += _apply(l, replicate, a, q, phy, r_LE, cnt_LEG, old_LEG, in_G, S, span, grp_E, node_G, gn_LKN)
    return total


@kernel(inline=True, error_model="numpy")
def _price_active(load_LE, phy, r_LE, cnt_LEG, old_LEG, room_G, room_tot, min_gain_L, active, G, S, C, D,
                  span, grp_E, node_G, gn_LKN, fw, iw, kind, slot_a, slot_q):
    """Best change of every active layer l into kind[l] (1 replicate, 0 swap), slot_a[l],
    slot_q[l]; returns the layers with a change, best key first (ties by active order)."""
    A = active.size
    best_A = np.empty(A)
    for ai in range(A):
        l = active[ai]
        key, replicate, a, q = _best_change(
            l, phy, load_LE, r_LE, cnt_LEG, old_LEG, room_G, room_tot, min_gain_L[l], G, S, C, D, fw, iw,
            span, grp_E, node_G, gn_LKN)
        kind[l] = 1 if replicate else 0
        slot_a[l] = a
        slot_q[l] = q
        best_A[ai] = key
    order_all = np.argsort(-best_A, kind="mergesort")
    n = 0
    for k in range(A):
        if np.isfinite(best_A[order_all[k]]):
            n += 1
    order = np.empty(n, dtype=np.int64)
    n = 0
    for k in range(A):
        if np.isfinite(best_A[order_all[k]]):
            order[n] = active[order_all[k]]
            n += 1
    return order


@kernel(inline=True, error_model="numpy")
def _apply_in_order(order, kind, slot_a, slot_q, phy, r_LE, cnt_LEG, old_LEG, in_G, total, cap_total, cap_gpu,
                    G, S, span, grp_E, node_G, gn_LKN):
    """Apply the changes of the layers in `order` that the budget can pay for; returns
    (move total, applied bool [n]). Upper bounds first (1 per replication, 1 onto each GPU of
    a swap): if they fit, every change is applied; otherwise best first, each re-checked
    with its signed moves."""
    n = order.size
    need_G = np.zeros(G, dtype=np.int64)
    up = 0
    for k in range(n):
        l = order[k]
        need_G[slot_q[l] // S] += 1
        up += 1
        if kind[l] == 0:
            need_G[slot_a[l] // S] += 1
            up += 1
    fit = up <= cap_total - total
    if fit and np.isfinite(cap_gpu):
        for g in range(G):
            if in_G[g] + need_G[g] > cap_gpu:
                fit = False
    applied = np.zeros(n, dtype=np.bool_)
    for k in range(n):
        l = order[k]
        a = slot_a[l]
        q = slot_q[l]
        g = q // S
        hh = a // S
        dg, dh = _move_deltas(l, a, q, S, phy, cnt_LEG, old_LEG)
        if kind[l] == 1:
            if not fit and (total + dg > cap_total or in_G[g] + dg > cap_gpu):
                continue
        elif not fit and (total + dg + dh > cap_total or in_G[g] + dg > cap_gpu or in_G[hh] + dh > cap_gpu):
            continue
        total += _apply(l, kind[l] == 1, a, q, phy, r_LE, cnt_LEG, old_LEG, in_G, S, span, grp_E, node_G, gn_LKN)
        applied[k] = True
    return total, applied


@kernel(error_model="numpy")
def search(load_LE, phy, r_LE, cnt_LEG, old_LEG, in_G, total, cap_total, cap_gpu,
           min_gain_L, active, G, S, C, D, iters, span, grp_E, node_G, gn_LKN):
    """Run the budgeted search in place on phy, r_LE, cnt_LEG, in_G (and gn_LKN when span > 0);
    returns the move total. Arguments: the fields of `eplb.migration.search.SearchState`."""
    P = G * S
    L = phy.shape[0]
    # Scratch of price_layer: the loads, then the larger of the swap and replication stages.
    fw = np.empty(2 * load_LE.shape[1] + 2 * P + G + C * S + 2 * D)
    iw = np.empty(C + 4 * C * S + 6 * D + D * G + 2 * G, dtype=np.int64)
    if not (np.isfinite(cap_total) or np.isfinite(cap_gpu)):
        return _search_uncapped(load_LE, phy, r_LE, cnt_LEG, old_LEG, in_G, total, min_gain_L, active, G, S, C, D,
                                iters, span, grp_E, node_G, gn_LKN, fw, iw)
    kind = np.zeros(L, dtype=np.int64)          # 1 replicate, 0 swap
    slot_a = np.zeros(L, dtype=np.int64)
    slot_q = np.zeros(L, dtype=np.int64)
    room_G = np.empty(G)
    for _ in range(iters):
        A = active.size
        if A == 0:
            break
        for g in range(G):
            room_G[g] = cap_gpu - in_G[g]
        order = _price_active(load_LE, phy, r_LE, cnt_LEG, old_LEG, room_G, cap_total - total, min_gain_L, active,
                              G, S, C, D, span, grp_E, node_G, gn_LKN, fw, iw, kind, slot_a, slot_q)
        if order.size == 0:
            break
        total, applied = _apply_in_order(order, kind, slot_a, slot_q, phy, r_LE, cnt_LEG, old_LEG, in_G, total,
                                         cap_total, cap_gpu, G, S, span, grp_E, node_G, gn_LKN)
        m = 0
        for k in range(order.size):
            if applied[k]:
                m += 1
        if m == 0:
            break
        # Keep the reference's layer order for the next iteration (ascending, as active[applied]).
        keep = np.zeros(L, dtype=np.bool_)
        for k in range(order.size):
            if applied[k]:
                keep[order[k]] = True
        nxt = np.empty(m, dtype=np.int64)
        m = 0
        for ai in range(A):
            if keep[active[ai]]:
                nxt[m] = active[ai]
                m += 1
        active = nxt
    return total


@kernel(error_model="numpy")
def holdings_LEG(phy2log_LP, G, E):
    """Compiled `migration.holdings` in the search's layout: replicas of each expert on each
    GPU, int16 [L, E, G] (slots < 0 skipped)."""
    L, P = phy2log_LP.shape
    S = P // G
    out = np.zeros((L, E, G), dtype=np.int16)
    for l in range(L):
        for p in range(P):
            e = phy2log_LP[l, p]
            if e >= 0:
                out[l, e, p // S] += 1
    return out
