"""Greedy replication + packing, vectorised over layers (DeepSeek's EPLB idea, done better).

Legend: L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU, P = G x S slots.

Step 1: replicate. Each redundant slot goes to the expert with the highest load per replica
        (optimal for max_e load_e / r_e; an expert gets at most G replicas).
Step 2: pack. Replicas, heaviest first, each go to the least-loaded GPU that has a free slot
        and does not yet hold that expert (longest-processing-time with slot limits).
Step 3: (optional, `refine_rounds`) refine. Swap a replica on the busiest GPU with one elsewhere while that lowers the
        busiest GPU's load (all layers at once; stops when no swap helps).
All layers move in lock-step, so one numpy call does a step for every layer.
"""

from __future__ import annotations

import numpy as np

from eplb.errors import EplbError, whole_number
from eplb.planner_api import PlanRequest, Solution
from eplb.stats import replica_counts_minmax


def replicate(load_LE: np.ndarray, num_slots: int, num_gpus: int) -> np.ndarray:
    """Replica count per expert r [L, E]: sum P, 1 <= r_e <= G."""
    return replica_counts_minmax(load_LE, num_slots, max_replicas=num_gpus)


def pack(load_LE: np.ndarray, count_LE: np.ndarray, num_gpus: int, slots_per_gpu: int) -> np.ndarray:
    """Place replicas on GPUs, heaviest first, onto the least-loaded GPUs; returns phy2log_LP.

    Each replica of expert e carries load_e / count_e (an even split); see `pack_replicas`.
    """
    return pack_replicas(load_LE / count_LE, count_LE, num_gpus, slots_per_gpu)


def pack_replicas(per_LE: np.ndarray, count_LE: np.ndarray, num_gpus: int, slots_per_gpu: int) -> np.ndarray:
    """Place count_LE[l, e] replicas of load per_LE[l, e] each on GPUs; returns phy2log_LP.

    Rows may be any batch (layers, or layers x nodes); each row's counts must sum to G x S,
    and no count may exceed G. A count of 0 places nothing (node-local packing uses that).

    Done in S rounds: round k hands the next G heaviest replicas, heaviest first, to the GPUs
    in order of their load so far, lightest first. Every GPU gets exactly one replica per
    round (the slot limit holds by construction), and this is what longest-processing-time
    with a slot limit does on skewed loads, at S numpy steps instead of P.
    """
    L, E = per_LE.shape
    G, S = num_gpus, slots_per_gpu
    P = G * S
    rows = np.arange(L)[:, None]
    # Heaviest replicas first (np.repeat keeps one expert's replicas adjacent). Quicksort, not a
    # stable sort: faster, still deterministic, and the order among equal loads changes which
    # GPU gets which equal replica, never any GPU's load.
    order_LE = np.argsort(-per_LE, axis=1)
    rep_expert_LP = np.repeat(order_LE.ravel(), np.take_along_axis(count_LE, order_LE, 1).ravel()).reshape(L, P)
    rep_load_LP = np.take_along_axis(per_LE, rep_expert_LP, axis=1)

    phy2log_LGS = np.empty((L, G, S), dtype=np.int64)
    gpu_load_LG = np.zeros((L, G))
    for k in range(S):
        lightest_LG = np.argsort(gpu_load_LG, axis=1, kind="stable")
        first_L = rep_expert_LP[:, k * G]
        straddle = np.flatnonzero(first_L == rep_expert_LP[:, k * G - 1]) if k else ()
        if len(straddle):
            # Only the expert that opens round k can already sit on a GPU (from round k - 1):
            # its m replicas here take the m lightest GPUs that do not hold it yet.
            f_A = first_L[straddle]
            held_AG = (phy2log_LGS[straddle, :, k - 1] == f_A[:, None])
            sorted_AG = lightest_LG[straddle]
            free_AG = ~np.take_along_axis(held_AG, sorted_AG, axis=1)
            m_A = (rep_expert_LP[straddle, k * G:(k + 1) * G] == f_A[:, None]).sum(axis=1)
            take_AG = free_AG & (np.cumsum(free_AG, axis=1) <= m_A[:, None])
            lightest_LG[straddle] = np.take_along_axis(sorted_AG, np.argsort(~take_AG, axis=1, kind="stable"), axis=1)
        phy2log_LGS[rows, lightest_LG, k] = rep_expert_LP[:, k * G:(k + 1) * G]
        gpu_load_LG[rows, lightest_LG] += rep_load_LP[:, k * G:(k + 1) * G]
    return phy2log_LGS.reshape(L, P)


def refine(phy2log_LP: np.ndarray, load_LE: np.ndarray, count_LE: np.ndarray, num_gpus: int,
           max_rounds: int = 64, per_LE: np.ndarray | None = None) -> np.ndarray:
    """Lower each layer's busiest GPU by pairwise replica swaps (in place; returns phy2log_LP).

    Rows may be any batch (layers, or layers x nodes with G = GPUs per node). Each replica
    carries per_LE (default load_LE / count_LE, an even split).
    """
    L, P = phy2log_LP.shape
    G = num_gpus
    S = P // G
    if per_LE is None:
        per_LE = load_LE / count_LE
    active = np.arange(L)
    for _ in range(max_rounds):
        if active.size == 0:
            break
        phy = phy2log_LP[active]                                            # [A, P]
        w_AP = np.take_along_axis(per_LE[active], phy, axis=1)
        w_AGS = w_AP.reshape(-1, G, S)
        gl_AG = w_AGS.sum(axis=2)
        top = np.argmax(gl_AG, axis=1)                                  # busiest GPU
        A = active.size
        ar = np.arange(A)
        top_load = gl_AG[ar, top]
        wa_AS = w_AGS[ar, top]                                          # replicas on the busiest GPU
        ea_AS = phy.reshape(-1, G, S)[ar, top]
        # Swap slot a (busiest GPU) with slot b (GPU h): new loads of both GPUs.
        gpu_of_b = np.arange(P) // S
        delta_ASP = wa_AS[:, :, None] - w_AP[:, None, :]                # load moved from top to h
        new_top = top_load[:, None, None] - delta_ASP
        new_h = gl_AG[:, gpu_of_b][:, None, :] + delta_ASP
        new_max = np.maximum(new_top, new_h)
        # Forbidden: b on the busiest GPU; e_b already on top; e_a already on h.
        e_b_on_top = (phy[:, None, :] == ea_AS[:, :, None]).any(axis=1)  # [A, P]: is e_b on top
        phy2log_AGS = phy.reshape(-1, G, S)
        e_a_on_h = (phy2log_AGS[:, None, :, :] == ea_AS[:, :, None, None]).any(axis=3)  # [A, S, G]
        bad = (gpu_of_b[None, None, :] == top[:, None, None]) | e_b_on_top[:, None, :] | e_a_on_h[:, :, gpu_of_b]
        gain = np.where(bad, -np.inf, top_load[:, None, None] - new_max)
        flat = gain.reshape(A, -1).argmax(axis=1)
        best = gain.reshape(A, -1)[ar, flat]
        improve = best > 1e-9 * np.maximum(top_load, 1.0)
        if not improve.any():
            break
        ia = ar[improve]
        s_a, b = np.divmod(flat[improve], P)
        layers = active[improve]
        a_slot = top[improve] * S + s_a
        ea = phy2log_LP[layers, a_slot].copy()
        phy2log_LP[layers, a_slot] = phy2log_LP[layers, b]
        phy2log_LP[layers, b] = ea
        # A swap can leave another GPU as tied busiest; keep going while some layer improves.
        active = layers
        del ia
    return phy2log_LP


def plan_greedy(load_LE: np.ndarray, num_gpus: int, slots_per_gpu: int, refine_rounds: int = 0) -> np.ndarray:
    """The whole greedy plan: replicate, pack, refine. Returns phy2log_LP."""
    load_LE = np.asarray(load_LE, dtype=np.float64)
    P = num_gpus * slots_per_gpu
    E = load_LE.shape[1]
    if P < E:
        raise EplbError(f"{num_gpus} GPUs x {slots_per_gpu} slots = {P} slots cannot hold {E} experts")
    if P > num_gpus * E:
        raise EplbError(f"{P} slots need more than one replica of an expert per GPU ({E} experts, {num_gpus} GPUs)")
    count_LE = replicate(load_LE, P, num_gpus)
    phy2log_LP = pack(load_LE, count_LE, num_gpus, slots_per_gpu)
    if refine_rounds:
        refine(phy2log_LP, load_LE, count_LE, num_gpus, refine_rounds)
    return phy2log_LP


class GreedyPlanner:
    """Replicate by load per replica, pack heaviest-first; even dispatch.

    refine_rounds: rounds of busiest-GPU swaps after packing (0 = off, the default: packing
    alone is already close to the lower bound; each round closes part of the rest at the cost
    of a swap search, see benchmarks/bench_greedy.py).
    """

    name = "greedy"

    def __init__(self, refine_rounds: int = 0):
        self.refine_rounds = whole_number("refine_rounds", refine_rounds)

    def plan(self, request: PlanRequest) -> Solution:
        t = request.topology
        return Solution(plan_greedy(request.load_LE, t.num_gpus, t.slots_per_gpu, self.refine_rounds))
