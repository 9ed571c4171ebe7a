"""Local scores of one-change candidates for the re-split search (numpy; eplb.planning.resplit_repair).

Legend: M = scenarios, L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU, P = G x S
slots, C = candidates, K = experts a candidate re-pours, X = most GPUs one of them spans.

A candidate (a swap of two slots, or a spare replica rewritten to another expert) changes what two
GPUs hold. Re-running water-filling over the whole layer from the even split for each candidate
costs as much as scoring the layer; instead each candidate starts from the placement's own split,
kept per slot (`slot_flows`), which stays a feasible split of the changed map once the tokens move
with the slots: a swap trades the two slots' contents and their tokens, a rewritten slot starts
empty and its old expert's tokens there go to that expert's other replica with the most. Then
only the experts near the two changed GPUs pour again (on them, or HOPS steps of shared GPUs
away), LOCAL_SWEEPS times. Every split is feasible,
so every score is an upper bound on the candidate's re-split optimum, as the full one is.
"""

from __future__ import annotations

import numpy as np

from eplb.dispatch.resplit_score import Layout, water_fill

LOCAL_SWEEPS = 8
"""Sweeps of water-filling over the experts on the changed GPUs that score a candidate."""

HOPS = 2
"""Times the changed GPUs grow by the other GPUs of the experts on them before those experts pour."""

CHUNK = 1 << 22
"""Most (scenario x candidate x GPU or slot) entries scored at once (memory)."""


def slot_flows(lay: Layout, flow_MBRX: np.ndarray, load_MBE: np.ndarray, phy_BP: np.ndarray) -> np.ndarray:
    """The split of the state (flow of each flexible expert on each of its GPUs) per slot, [M, B, P + S]
    (the columns past P are padding, always 0): the tokens an expert sends to a GPU sit on its first
    slot there, the other slots of it on that GPU hold none."""
    M, B, E = load_MBE.shape
    P = phy_BP.shape[1]
    S = P // lay.num_gpus
    out = np.zeros((M, B, P + S))
    rows = np.arange(B)[:, None, None]
    out[:, rows, lay.slot_BRX] = flow_MBRX
    b, p = lay.rigid_slot // P, lay.rigid_slot % P
    out.reshape(M, B * (P + S))[:, b * (P + S) + p] = load_MBE[:, b, phy_BP[b, p]]
    out[:, :, P:] = 0.0
    return out


def _changed(cand, cur_LP, flow_MLQ, gpu_MLG, S):
    """The candidates' maps [C, P], split per slot [M, C, P + S] and GPU loads [M, C, G + 1] after
    the change, with the second GPU each changes [C] (module docstring)."""
    l, a, b, x = cand[:, 0], cand[:, 1], cand[:, 2], cand[:, 3]
    C = len(cand)
    rows = np.arange(C)
    swap = b >= 0
    phy = cur_LP[l].copy()
    flow = flow_MLQ[:, l].copy()
    gpu = gpu_MLG[:, l].copy()
    g = a // S
    f_a = flow[:, rows, a]
    # Step 1: swaps trade the slots' experts and tokens.
    sw, bs = rows[swap], b[swap]
    phy[sw, a[swap]], phy[sw, bs] = cur_LP[l[swap], bs], cur_LP[l[swap], a[swap]]
    f_b = flow[:, sw, bs]
    d = f_b - f_a[:, swap]
    flow[:, sw, a[swap]], flow[:, sw, bs] = f_b, f_a[:, swap]
    gpu[:, sw, g[swap]] += d
    gpu[:, sw, bs // S] -= d
    # Step 2: a rewritten slot starts empty; its tokens go to its old expert's fullest other replica.
    rw = rows[~swap]
    old = cur_LP[l[rw]]
    other = old == old[np.arange(len(rw)), a[rw]][:, None]
    other[np.arange(len(rw)), a[rw]] = False
    total = flow[:, rw, :old.shape[1]].sum(axis=0)
    recv = np.argmax(np.where(other, total, -1.0), axis=1)
    phy[rw, a[rw]] = x[rw]
    flow[:, rw, recv] += f_a[:, ~swap]
    flow[:, rw, a[rw]] = 0.0
    gpu[:, rw, g[rw]] -= f_a[:, ~swap]
    gpu[:, rw, recv // S] += f_a[:, ~swap]
    h = np.where(swap, np.maximum(b, 0) // S, 0)
    h[rw] = recv // S
    return phy, flow, gpu, h


def _first_true(mask_NY: np.ndarray, Y: int, fill: int) -> np.ndarray:
    """The indices of the first Y true entries of each row of mask_NY [..., Z], ascending, [..., Y]
    (padding `fill`): what a stable argsort of ~mask keeps of them, without the sort."""
    lead, Z = mask_NY.shape[:-1], mask_NY.shape[-1]
    row, col = np.nonzero(mask_NY.reshape(-1, Z))
    rank = np.arange(len(row)) - np.searchsorted(row, row)       # place among its row's true entries
    keep = rank < Y
    out = np.full((int(np.prod(lead)), Y), fill, dtype=np.int64)
    out[row[keep], rank[keep]] = col[keep]
    return out.reshape(lead + (Y,))


def _spans(phy_CP, on_CG, G):
    """The experts with a replica on the GPUs on_CG [C, G] that span two GPUs or more: (their ids
    [C, K] (padding -1), their GPUs [C, K, X] (padding G))."""
    C, P = phy_CP.shape
    S = P // G
    mask_CP = np.repeat(on_CG, S, axis=1)
    slots = _first_true(mask_CP, max(1, int(mask_CP.sum(axis=1).max())), P)
    act = np.sort(np.where(slots < P, np.take_along_axis(phy_CP, np.minimum(slots, P - 1), axis=1), -1), axis=1)
    act[:, 1:][act[:, 1:] == act[:, :-1]] = -1
    same_CKGS = (phy_CP[:, None, :] == act[:, :, None]).reshape(C, -1, G, S)
    hold_CKG = same_CKGS[..., 0].copy()
    for s in range(1, S):
        hold_CKG |= same_CKGS[..., s]
    span_CK = hold_CKG.sum(axis=2)
    # Keep the experts that can move tokens (two GPUs or more), first.
    order = np.argsort(span_CK < 2, axis=1, kind="stable")[:, :max(1, int((span_CK >= 2).sum(axis=1).max()))]
    live_CK = np.take_along_axis(span_CK, order, axis=1) >= 2
    act = np.where(live_CK, np.take_along_axis(act, order, axis=1), -1)
    hold_CKG = np.take_along_axis(hold_CKG, order[:, :, None], axis=1) & live_CK[:, :, None]
    return act, _first_true(hold_CKG, max(1, int(hold_CKG.sum(axis=2).max())), G)


def _flows(phy_CP, flow_MCQ, act_CK, gpus_CKX, G):
    """Tokens of each expert act_CK on each of its GPUs gpus_CKX, [M, C, K, X]: the sum over its
    slots there of the split per slot flow_MCQ (at most one of them holds tokens: `slot_flows`,
    `_changed`, so the order of the sum does not matter)."""
    C, P = phy_CP.shape
    M, S = flow_MCQ.shape[0], P // G
    slot_CKXS = gpus_CKX[..., None] * S + np.arange(S)             # the dummy GPU G: padding slots P..P + S - 1
    phy_CQ = np.concatenate([phy_CP, np.full((C, S), -1)], axis=1)
    rows = np.arange(C)[:, None, None, None]
    mine = (phy_CQ[rows, slot_CKXS] == act_CK[:, :, None, None]) & (act_CK[:, :, None, None] >= 0)
    took = flow_MCQ.reshape(M, C * (P + S))[:, rows * (P + S) + slot_CKXS]
    return np.where(mine, took, 0.0).sum(axis=4)


def score_local(cand: np.ndarray, cur_LP: np.ndarray, flow_MLQ: np.ndarray, gpu_MLG: np.ndarray,
                load_MLE: np.ndarray, G: int, hops: int = HOPS, sweeps: int = LOCAL_SWEEPS) -> np.ndarray:
    """Busiest GPU of each scenario for each candidate [M, C], in tokens: the candidates are rows
    (layer, slot a, slot b or -1, new expert of a rewrite) [C, 4] on the map cur_LP [L, P] whose
    split per slot is flow_MLQ [M, L, P + S] (`slot_flows`) and GPU loads gpu_MLG [M, L, G + 1];
    the experts `hops` steps of shared GPUs from the changed GPUs pour `sweeps` times."""
    M, L, E = load_MLE.shape
    P = cur_LP.shape[1]
    S = P // G
    out = np.empty((M, len(cand)))
    step = max(1, CHUNK // max(1, M * (G + 1 + 3 * P + S)))
    for i in range(0, len(cand), step):
        c = cand[i:i + step]
        phy, flow, gpu, h = _changed(c, cur_LP, flow_MLQ, gpu_MLG, S)
        rows = np.arange(len(c))[:, None]
        on_CG = np.zeros((len(c), G + 1), dtype=bool)
        on_CG[rows, np.c_[c[:, 1] // S, h]] = True
        for _ in range(hops):
            gpus = _spans(phy, on_CG[:, :G], G)[1]
            on_CG[np.broadcast_to(rows[:, :, None], gpus.shape), gpus] = True
        act, gpus = _spans(phy, on_CG[:, :G], G)
        load_MCK = np.take_along_axis(load_MLE[:, c[:, 0]], np.broadcast_to(np.maximum(act, 0), (M,) + act.shape),
                                      axis=2) * (act >= 0)
        water_fill(gpus, load_MCK, gpu, _flows(phy, flow, act, gpus, G), sweeps)
        out[:, i:i + step] = gpu[:, :, :G].max(axis=2)
    return out
