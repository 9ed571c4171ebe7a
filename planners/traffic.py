"""Traffic-aware placement: balanced first, then co-activated experts kept on one GPU.

Legend: L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU, P = G x S slots,
T = sampled tokens, K = experts per token, I = replicas of one layer (= P), N = nodes.

Dispatch sends a token's hidden state once to every GPU that holds one of its experts, and
combine brings one result back from each (eplb.dispatch.cost). Tokens sit on every GPU alike
(attention is data-parallel), so a token's expected inter-node bytes are (N - 1) / N of its
distinct destination GPUs and its intra-node bytes 1/N - 1/G of them: both fall when experts
that the same tokens choose share a GPU. No engine's balancer looks at this.
Step 1: balance. The `base` planner's placement (default greedy) on the planning load.
Step 2: co-locate. Per layer, replica swaps between two GPUs, best first, while they lower the
        distinct destination GPUs summed over the sampled tokens (per-token choices from the
        history, the newest `max_tokens`; an expert's tokens are dealt to its replicas in turn,
        as an even split does) and keep every GPU's planning load within `tolerance` of the
        base plan's busiest GPU. The gain of every swap is exact and computed for all pairs at
        once: with cnt[t, g] = replicas of token t on GPU g, moving replica a from GPU A to B
        saves the tokens with cnt[t, A] == 1 and costs those with cnt[t, B] == 0; a swap with
        b adds b's move and takes back the tokens that hold both (their GPUs do not change).
Needs per-token expert choices (a trace with `topk_ids`); without them it returns the base plan
with status FALLBACK and says so.
"""

from __future__ import annotations

import numpy as np

from eplb.errors import EplbError, fraction, whole_number
from planners.api import PlanRequest, Solution, get_planner


def _deal(ids_TK: np.ndarray, phy2log_P: np.ndarray, E: int) -> np.ndarray:
    """Slot of every (token, pick), [T, K]: an expert's picks go to its replicas in turn."""
    T, K = ids_TK.shape
    order = np.argsort(phy2log_P, kind="stable")
    count_E = np.bincount(phy2log_P, minlength=E)
    first_E = np.cumsum(count_E) - count_E
    flat = ids_TK.ravel()
    # Occurrence of each pick among its expert's picks, in token order.
    o = np.argsort(flat, kind="stable")
    n_E = np.bincount(flat, minlength=E)
    turn = np.empty_like(flat)
    turn[o] = np.arange(flat.size) - (np.cumsum(n_E) - n_E)[flat[o]]
    return order[first_E[flat] + turn % count_E[flat]].reshape(T, K)


def colocate_layer(phy2log_P: np.ndarray, ids_TK: np.ndarray, load_E: np.ndarray, num_gpus: int,
                   tolerance: float, max_swaps: int) -> tuple[np.ndarray, int]:
    """Swap replicas of one layer between GPUs to cut distinct GPUs per token (see Step 2).

    The sums behind the gains are kept up to date after each swap from the tokens it touched
    (those holding either replica), not recomputed over all tokens."""
    P = phy2log_P.size
    G, S = num_gpus, P // num_gpus
    E = load_E.size
    slot_TK = _deal(ids_TK, phy2log_P, E)
    T, K = slot_TK.shape
    expert_I = phy2log_P.copy()
    gpu_I = np.arange(P) // S
    w_I = load_E[expert_I] / np.bincount(expert_I, minlength=E)[expert_I]
    load_G = np.bincount(gpu_I, weights=w_I, minlength=G)
    cap = (1.0 + tolerance) * load_G.max()
    cap += 1e-9 * cap
    holds_GE = np.zeros((G, E), dtype=bool)
    holds_GE[gpu_I, expert_I] = True
    # Tokens of each replica (CSR), to find the tokens a swap touches.
    by_slot = np.argsort(slot_TK.ravel(), kind="stable")
    starts = np.searchsorted(slot_TK.ravel()[by_slot], np.arange(P + 1))
    pair_a, pair_b = np.triu_indices(K, 1)

    def sums(rows):
        """For tokens `rows`: sum over their picks of [cnt == 1] and [cnt == 0] ([I, G]), and
        over their pairs of picks of [cnt == 1] at the first one's GPU ([I, I], both orders).
        Sparse (bincounts over K picks and K(K-1)/2 pairs per token), no dense products."""
        sl = slot_TK[rows]
        R = len(sl)
        tok = np.repeat(np.arange(R), K)
        cnt_RG = np.bincount(tok * G + gpu_I[sl].ravel(), minlength=R * G).reshape(R, G)
        one_RG, none_RG = cnt_RG == 1, cnt_RG == 0
        flat = sl.ravel()
        one_NG, none_NG = one_RG[tok], none_RG[tok]
        one = np.stack([np.bincount(flat, weights=one_NG[:, g], minlength=P) for g in range(G)], axis=1)
        none = np.stack([np.bincount(flat, weights=none_NG[:, g], minlength=P) for g in range(G)], axis=1)
        a, b = sl[:, pair_a].ravel(), sl[:, pair_b].ravel()
        t = np.repeat(np.arange(R), len(pair_a))
        w_ab = one_RG[t, gpu_I[a]]                              # pick a alone on its GPU
        w_ba = one_RG[t, gpu_I[b]]
        both = (np.bincount(a * P + b, weights=w_ab, minlength=P * P)
                + np.bincount(b * P + a, weights=w_ba, minlength=P * P)).reshape(P, P)
        return one, none, both

    one_IG, none_IG, both_II = sums(slice(None))
    swaps = 0
    other = gpu_I[:, None] != gpu_I[None, :]
    while swaps < max_swaps:
        leave_I = one_IG[np.arange(P), gpu_I]                 # tokens that stop touching the old GPU
        move_II = leave_I[:, None] - none_IG[:, gpu_I]         # move replica a to b's GPU
        gain_II = move_II + move_II.T - both_II - both_II.T
        # Feasible: another GPU, no second copy of an expert on one GPU, balance kept.
        delta_II = w_I[:, None] - w_I[None, :]
        ok = other & (np.maximum(load_G[gpu_I][:, None] - delta_II, load_G[gpu_I][None, :] + delta_II) <= cap)
        ok &= ~holds_GE[gpu_I[None, :], expert_I[:, None]] & ~holds_GE[gpu_I[:, None], expert_I[None, :]]
        gain_II = np.where(ok, gain_II, -np.inf)
        a, b = np.unravel_index(int(np.argmax(gain_II)), gain_II.shape)
        if not gain_II[a, b] > 0.5:                            # gains are whole tokens
            break
        rows = np.unique(np.concatenate([by_slot[starts[a]:starts[a + 1]], by_slot[starts[b]:starts[b + 1]]]) // K)
        before = sums(rows)
        ga, gb = gpu_I[a], gpu_I[b]
        holds_GE[ga, expert_I[a]] = holds_GE[gb, expert_I[b]] = False
        gpu_I[a], gpu_I[b] = gb, ga
        holds_GE[gb, expert_I[a]] = holds_GE[ga, expert_I[b]] = True
        load_G[ga] += w_I[b] - w_I[a]
        load_G[gb] += w_I[a] - w_I[b]
        other = gpu_I[:, None] != gpu_I[None, :]
        after = sums(rows)
        one_IG += after[0] - before[0]
        none_IG += after[1] - before[1]
        both_II += after[2] - before[2]
        swaps += 1
    # Replicas back into slots, GPU by GPU.
    out = np.empty(P, dtype=np.int64)
    for g in range(G):
        out[g * S:(g + 1) * S] = expert_I[gpu_I == g]
    return out, swaps


class TrafficPlanner:
    """Balance with `base`, then swap replicas so co-activated experts share GPUs.

    base: planner of Step 1 (its settings are not exposed: use its defaults).
    tolerance: each GPU's planning load may exceed the base plan's busiest GPU by this share.
    max_tokens: newest per-token rows of the history the swaps look at.
    max_swaps: per layer.
    """

    name = "traffic"

    def __init__(self, base: str = "greedy", tolerance: float = 0.02, max_tokens: int = 8192, max_swaps: int = 200):
        if base == "traffic":
            raise EplbError("planner traffic cannot use itself as its base planner: give base=greedy or another")
        self.base = get_planner(base)
        self.tolerance = fraction("tolerance", tolerance, low_open=False, high_open=True)
        self.max_tokens = whole_number("max_tokens", max_tokens, 1)
        self.max_swaps = whole_number("max_swaps", max_swaps, 0)

    def plan(self, request: PlanRequest) -> Solution:
        base = self.base.plan(request)
        if request.topk_ids_NLK is None or not len(request.topk_ids_NLK):
            return Solution(base.phy2log_LP, base.dispatch_weights_LP, "FALLBACK",
                            f"no per-token expert choices in the trace (topk_ids, which eplb's collectors write): "
                            f"returned {self.base.name}'s plan without co-location", dict(base.info))
        ids_NLK = np.asarray(request.topk_ids_NLK[-self.max_tokens:], dtype=np.int64)
        phy2log_LP = np.array(base.phy2log_LP, dtype=np.int64)
        G = request.topology.num_gpus
        swaps = []
        for l in range(request.num_layers):
            phy2log_LP[l], n = colocate_layer(phy2log_LP[l], ids_NLK[:, l], request.load_LE[l], G,
                                              self.tolerance, self.max_swaps)
            swaps.append(n)
        info = {"base": self.base.name, "swaps": int(sum(swaps)), "tokens": int(len(ids_NLK)),
                "tolerance": self.tolerance, **({"base_info": base.info} if base.info else {})}
        return Solution(phy2log_LP, None, base.status, f"{self.base.name} balanced, then {sum(swaps)} swaps "
                        f"for co-activation on {len(ids_NLK)} tokens", info)
