"""Compiled pricing of the budgeted search (numba): the best change of one layer.

Legend: E = logical experts, G = GPUs, S = slots per GPU, P = G x S slots, C = partner
(lightest) GPUs per swap, Q = C x S partner slots, D = donor slots, K = expert groups,
N = nodes. Arrays of one layer: ld (load per expert, [E]), r (replicas per expert, [E]),
ph (expert in each slot, [P]), cnt (replicas of each expert on each GPU, [E, G]), old
(held in the old placement, bool [E, G]).

`price_layer` runs three stages: `_layer_loads` (per-slot and per-GPU loads, the busiest GPU
h and the C lightest), `_price_swaps` and `_price_replications`. They price exactly the
candidates of the numpy reference (tests/oracles/search.py) with the same arithmetic in
the same order (so the same float64 values) and the same first-maximum tie-breaking;
a candidate is skipped early only when an exact bound shows it cannot win. Scratch comes
from two buffers `search` allocates once (fw: float64, iw: int64): `price_layer` carves the
loads from their heads and hands each stage the tails, which the stages reuse in turn.
"""

from __future__ import annotations

import numpy as np

from eplb.core.jit import kernel


@kernel(error_model="numpy")
def _carve(buf, o, n):
    """The next n entries of scratch buf from offset o, and the offset after them."""
    return buf[o:o + n], o + n


@kernel(error_model="numpy")
def _keep_smallest(values, i, out, n, k):
    """Insert index i into out[:n], the indices of the (at most k) smallest values seen so far
    in increasing order, earlier insertions first among ties (a stable sort's first k, in one
    pass: a full sort per layer and iteration costs more than the pricing). Returns the new n."""
    v = values[i]
    if n == k and not v < values[out[k - 1]]:
        return n
    j = n if n < k else k - 1
    while j > 0 and v < values[out[j - 1]]:
        out[j] = out[j - 1]
        j -= 1
    out[j] = i
    return n + 1 if n < k else n


@kernel(error_model="numpy")
def _span_delta_swap(A, B, nh, ng, gn_KN):
    """(group, node) pairs added minus removed when group A's replica moves from node nh to ng
    and group B's from ng to nh."""
    if A == B or nh == ng:
        return 0
    new = (1 if gn_KN[A, ng] == 0 else 0) + (1 if gn_KN[B, nh] == 0 else 0)
    gone = (1 if gn_KN[B, ng] == 1 else 0) + (1 if gn_KN[A, nh] == 1 else 0)
    return new - gone


@kernel(error_model="numpy")
def _span_delta_copy(X, B, ng, gn_KN):
    """(group, node) pairs added minus removed when a replica of group X overwrites one of
    group B on node ng."""
    if X == B:
        return 0
    return (1 if gn_KN[X, ng] == 0 else 0) - (1 if gn_KN[B, ng] == 1 else 0)


@kernel(inline=True, error_model="numpy")
def _layer_loads(ld, r, ph, G, S, C, wE, w, gl, light):
    """Fill w (load of each slot, [P]) and gl (of each GPU, [G], summed slot by slot as the
    reference does) and light (the C lightest GPUs, lightest first); returns the busiest GPU h.
    wE: scratch [E]."""
    E = ld.shape[0]
    P = G * S
    for e in range(E):
        wE[e] = ld[e] / r[e]
    for p in range(P):
        w[p] = wE[ph[p]]
    for g in range(G):
        acc = w[g * S]
        for s in range(1, S):
            acc = acc + w[g * S + s]
        gl[g] = acc
    # The reference sorts -gl stably: h is the first busiest GPU, and the C lightest are the
    # last C of that order reversed (lightest first, the higher index first among ties).
    h = 0
    for g in range(1, G):
        if gl[g] > gl[h]:
            h = g
    n = 0
    for g in range(G - 1, -1, -1):
        n = _keep_smallest(gl, g, light, n, C)
    return h


@kernel(inline=True, error_model="numpy")
def _price_swaps(ph, cnt, old, w, gl, h, light, room_G, room_tot, need, S, span, grp_E, node_G, gn_KN, fw, iw):
    """Best swap of slot a on the busiest GPU h with slot q on one of the lightest GPUs
    `light`: (key, flat index s * Q + qi), key -inf when none passes the threshold."""
    C = light.shape[0]
    Q = C * S
    Lh = gl[h]
    wq_Q, _ = _carve(fw, 0, Q)
    o = 0
    eb_Q, o = _carve(iw, o, Q)
    ok_Q, o = _carve(iw, o, Q)  # eb not on h, g != h
    dh_in_Q, o = _carve(iw, o, Q)  # 1 if eb lands on h where it was not before
    out_g_Q, o = _carve(iw, o, Q)  # 1 if eb leaves g, its only copy moved there
    # Everything that depends on q alone is gathered once (Q values), not per (s, q).
    for qi in range(Q):
        g = light[qi // S]
        q = g * S + qi % S
        eb = ph[q]
        eb_Q[qi] = eb
        wq_Q[qi] = w[q]
        ok_Q[qi] = 1 if (cnt[eb, h] == 0 and g != h) else 0
        dh_in_Q[qi] = 0 if old[eb, h] else 1
        out_g_Q[qi] = 1 if ((not old[eb, g]) and cnt[eb, g] == 1) else 0
    # Starting from -inf and replacing only on a strictly larger key picks the same index as
    # the reference's first maximum (index 0 when every key is -inf).
    skey = -np.inf
    s_i = 0
    for s in range(S):
        a = h * S + s
        ea = ph[a]
        wa = w[a]
        out_h = 1 if ((not old[ea, h]) and cnt[ea, h] == 1) else 0
        for c in range(C):
            g = light[c]
            if cnt[ea, g] != 0:
                continue
            in_g = 0 if old[ea, g] else 1
            glg = gl[g]
            rg = room_G[g]
            for qi in range(c * S, (c + 1) * S):
                eb = eb_Q[qi]
                if ok_Q[qi] == 0 or ea == eb:
                    continue
                d_g = in_g - out_g_Q[qi]
                d_h = dh_in_Q[qi] - out_h
                cost = d_g + d_h
                if d_g > rg or d_h > room_G[h] or cost > room_tot:
                    continue
                delta = wa - wq_Q[qi]
                gain = Lh - max(Lh - delta, glg + delta)
                # Exact bounds first (the price is >= 0.25 in the key and >= 1 in the
                # threshold): most candidates stop here, before the span lookups.
                if gain < need or gain * 4.0 <= skey:
                    continue
                price = float(cost)
                if span > 0.0:
                    dsp = _span_delta_swap(grp_E[ea], grp_E[eb], node_G[h], node_G[g], gn_KN)
                    if dsp > 0 and span == np.inf:
                        continue
                    price += span * dsp
                if gain >= need * max(price, 1.0):
                    key = gain / max(price, 0.25)
                    if key > skey:
                        skey = key
                        s_i = s * Q + qi
    return skey, s_i


@kernel(inline=True, error_model="numpy")
def _donors(ld, r, ph, cnt, old, w, gl, h, S, hE, harm, q_D, b_D, gq_D, db_D, wdb_D, cb_D, out_D, nb):
    """Choose the D donor slots of a replication (harm: how little losing a replica hurts,
    light GPU and light expert first; slots on h and of single-replica experts are inf) and
    gather what their prices need: expert b_D, GPU gq_D, load rise per remaining replica of
    b db_D, wdb_D = w[q] + db (as the reference adds them), cb_D = cnt[b, gq], out_D (1 if b
    leaves gq where it was moved) and nb = -1 (GPUs holding b not listed yet)."""
    E = ld.shape[0]
    P = ph.shape[0]
    D = q_D.shape[0]
    for e in range(E):
        hE[e] = ld[e] / max(r[e] - 1, 1) if r[e] >= 2 else np.inf
    for p in range(P):
        gp = p // S
        harm[p] = gl[gp] + hE[ph[p]] if gp != h else np.inf
    if D < P:
        # The first D of a stable sort of harm (D smallest, ties by slot index).
        n = 0
        for p in range(P):
            n = _keep_smallest(harm, p, q_D, n, D)
    else:
        for d in range(D):
            q_D[d] = d
    for d in range(D):
        q = q_D[d]
        b = ph[q]
        gq = q // S
        rb = float(r[b])
        wb_q = w[q]
        db = ld[b] / max(rb - 1, 1) - wb_q if rb >= 2 else 0.0
        b_D[d] = b
        gq_D[d] = gq
        db_D[d] = db
        wdb_D[d] = wb_q + db
        cb_D[d] = cnt[b, gq]
        out_D[d] = 1 if ((not old[b, gq]) and cnt[b, gq] == 1) else 0
        nb[d] = -1


@kernel(inline=True, error_model="numpy")
def _touched_max(cnt, gl, x, b, gq, dx, db, gx, nx, gb, nb):
    """Busiest GPU a replication of x over b touches other than gq: the max over GPUs holding x
    (gx[:nx], any b) and over GPUs holding b (gb[:nb], any x), as the reference's two passes.
    Only GPUs holding x or b can be finite in either pass, so only they are visited."""
    top = -np.inf
    for k in range(nx):
        g = gx[k]
        y = gl[g] - cnt[x, g] * dx
        v1 = y + cnt[b, g] * db
        if v1 > top:
            top = v1
    for k in range(nb):
        g = gb[k]
        if g != gq:
            y = gl[g] - cnt[x, g] * dx
            v2 = y + cnt[b, g] * db
            if v2 > top:
                top = v2
    return top


@kernel(inline=True, error_model="numpy")
def _price_replications(ld, r, ph, cnt, old, w, gl, h, room_G, room_tot, need, S, D, span, grp_E, node_G, gn_KN,
                        fw, iw):
    """Best replication: expert x on the busiest GPU h gets one more replica in donor slot q
    (expert b, r_b >= 2): (key, flat index s * D + d, q_D the donor slots, a view into iw)."""
    E, G, P = ld.shape[0], gl.shape[0], ph.shape[0]
    Lh = gl[h]
    o = 0
    hE, o = _carve(fw, o, E)
    harm, o = _carve(fw, o, P)
    db_D, o = _carve(fw, o, D)
    wdb_D, o = _carve(fw, o, D)
    o = 0
    q_D, o = _carve(iw, o, D)
    nb, o = _carve(iw, o, D)  # GPUs holding donor d's expert (-1: not listed yet)
    b_D, o = _carve(iw, o, D)
    gq_D, o = _carve(iw, o, D)
    cb_D, o = _carve(iw, o, D)
    out_D, o = _carve(iw, o, D)  # 1 if b leaves gq, its only copy moved there
    gb, o = _carve(iw, o, D * G)
    gx, o = _carve(iw, o, G)
    _donors(ld, r, ph, cnt, old, w, gl, h, S, hE, harm, q_D, b_D, gq_D, db_D, wdb_D, cb_D, out_D, nb)
    rkey = -np.inf
    r_i = 0
    for s in range(S):
        x = ph[h * S + s]
        rx = float(r[x])
        Wx = ld[x]
        wx1 = Wx / (rx + 1)
        dx = Wx / rx - wx1
        nx = -1                               # GPUs holding x, listed on first use
        for d in range(D):
            q = q_D[d]
            if not np.isfinite(harm[q]):
                continue
            b = b_D[d]
            gq = gq_D[d]
            cn_gx = cnt[x, gq]
            cost = (0 if old[x, gq] else 1) - out_D[d]
            if cn_gx > 0 or b == x or cost > room_G[gq] or cost > room_tot:
                continue
            db = db_D[d]
            at_g = (((gl[gq] - cn_gx * dx) + cb_D[d] * db) + wx1) - wdb_D[d]
            # gain = Lh - max(top, at_g) <= Lh - at_g (rounding is monotone): skip the
            # candidate when even that bound fails the threshold or cannot beat the best,
            # first at the most favourable price (0.25 in the key, 1 in the threshold).
            ub = Lh - at_g
            if not ub >= need or not ub * 4.0 > rkey:
                continue
            price = float(cost)
            if span > 0.0:
                dsp = _span_delta_copy(grp_E[x], grp_E[b], node_G[gq], gn_KN)
                if dsp > 0 and span == np.inf:
                    continue
                price += span * dsp
            if not ub >= need * max(price, 1.0) or not ub / max(price, 0.25) > rkey:
                continue
            if nx < 0:
                nx = 0
                for g in range(G):
                    if cnt[x, g] > 0:
                        gx[nx] = g
                        nx += 1
            if nb[d] < 0:
                m = 0
                for g in range(G):
                    if cnt[b, g] > 0:
                        gb[d * G + m] = g
                        m += 1
                nb[d] = m
            top = _touched_max(cnt, gl, x, b, gq, dx, db, gx, nx, gb[d * G:(d + 1) * G], nb[d])
            gain = Lh - max(top, at_g)
            if gain >= need * max(price, 1.0):
                key = gain / max(price, 0.25)
                if key > rkey:
                    rkey = key
                    r_i = s * D + d
    return rkey, r_i, q_D


@kernel(error_model="numpy")
def price_layer(l, phy, load_LE, r_LE, cnt_LEG, old_LEG, room_G, room_tot, need, G, S, C, D, fw, iw,
                span, grp_E, node_G, gn_KN):
    """Best swap and best replication of layer l: (skey, s_i, rkey, r_i, h, light_C, q_D).

    Keys are gain per move (-inf: no candidate passes the threshold `need` x moves); s_i and
    r_i are flat indices into the swap (s * C * S + qi) and replication (s * D + d) candidates
    of the busiest GPU h's slot s. fw, iw: float64 and int64 scratch allocated once by
    `search` (light_C and q_D are views into iw, valid until the next call).
    span > 0: every (group, node) pair a change adds to the layer (an expert group on a node
    where it had no replica), net of pairs it clears, costs `span` moves in its price (not
    in the budget); span = inf refuses such changes (grp_E: group of each expert, node_G:
    node of each GPU, gn_KN: replicas of each group on each node in this layer).
    """
    P = G * S
    E = load_LE.shape[1]
    ld = load_LE[l]
    r = r_LE[l]
    ph = phy[l]
    cnt = cnt_LEG[l]
    old = old_LEG[l]
    o = 0
    wE, o = _carve(fw, o, E)
    w, o = _carve(fw, o, P)
    gl, o = _carve(fw, o, G)
    light, oi = _carve(iw, 0, C)
    h = _layer_loads(ld, r, ph, G, S, C, wE, w, gl, light)
    skey, s_i = _price_swaps(ph, cnt, old, w, gl, h, light, room_G, room_tot, need, S, span, grp_E, node_G, gn_KN,
                             fw[o:], iw[oi:])
    rkey, r_i, q_D = _price_replications(ld, r, ph, cnt, old, w, gl, h, room_G, room_tot, need, S, D, span, grp_E,
                                         node_G, gn_KN, fw[o:], iw[oi:])
    return skey, s_i, rkey, r_i, h, light, q_D
