"""Greedy replication + packing + refinement (DeepSeek's EPLB idea, done better).

Legend: L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU, P = G x S slots.

Step 1: replicate. Each redundant slot goes to the expert with the highest load per replica
        (optimal for max_e load_e / r_e; an expert gets at most G replicas).
Step 2: pack. Replicas, heaviest first, each go to the least-loaded GPU that has a free slot
        and does not yet hold that expert (longest-processing-time with slot limits; run as S
        rounds of G while those agree with it).
Step 3: refine. Swap a replica on the busiest GPU with one on a lighter GPU while that lowers
        the busiest GPU's load (the swap leaving the pair's larger load lowest; refining until
        no swap helps, the first GPU, lightest first, whose swap leaves the pair at or below
        the second-busiest GPU); the greedy planner stops once the busiest GPU is within
        REFINE_GAP (0.1%) of the floor max(mean GPU load, heaviest replica).
The steps are kernels (planners/_greedy_kernel.py, eplb.core.jit); the functions here check
their input and hand whole [L, E] arrays to them.
"""

from __future__ import annotations

import numpy as np

from eplb.core.jit import kernel_floats, kernel_ints
from eplb.errors import EplbError, fraction, whole_number
from planners import _greedy_kernel
from planners._threads import run_blocks
from planners.api import PlanRequest, Solution

# The greedy planner (and the adaptive policy's fresh plans) stop refining a layer once its
# busiest GPU is within this fraction of its floor. The last swaps before the floor cost the
# most (at 32 GPUs on DeepSeek-V3 stopping here makes half the swaps, in 0.62-0.65x the plan's
# time) and what they buy does not survive a change of traffic: served on loads the plan did
# not see, a layer refined to the floor comes out heavier about as often as lighter than one
# stopped here (docs/planners.md, "refine_gap"; benchmarks/bench_refine_gap.py). The functions
# below default to 0, until no swap helps: hierarchical, ilp and rule-aware, whose plans cost
# far more than the refinement, keep every swap.
REFINE_GAP = 1e-3


def replicate(load_LE: np.ndarray, num_slots: int, num_gpus: int) -> np.ndarray:
    """Replica count per expert r [L, E]: sum P, 1 <= r_e <= G (ties: fewer replicas, then the
    lower expert id). Rows are independent: blocks of them run on threads."""
    kernel, load = _greedy_kernel, kernel_floats(load_LE)
    count_LE = np.empty(load.shape, dtype=np.int64)

    def rows(a: int, b: int) -> None:
        count_LE[a:b] = kernel.replicate(load[a:b], int(num_slots), int(num_gpus))

    run_blocks(rows, load.shape[0], int(num_slots))
    return count_LE


def pack(load_LE: np.ndarray, count_LE: np.ndarray, num_gpus: int, slots_per_gpu: int) -> np.ndarray:
    """Place replicas on GPUs, heaviest first, onto the least-loaded GPUs; returns phy2log_LP.

    Each replica of expert e carries load_e / count_e (an even split); see `pack_replicas`.
    """
    return pack_replicas(load_LE / count_LE, count_LE, num_gpus, slots_per_gpu)


def pack_replicas(per_LE: np.ndarray, count_LE: np.ndarray, num_gpus: int, slots_per_gpu: int) -> np.ndarray:
    """Place count_LE[l, e] replicas of load per_LE[l, e] each on GPUs; returns phy2log_LP.

    Rows may be any batch (layers, or layers x nodes); each row's counts must sum to G x S,
    and no count may exceed G. A count of 0 places nothing (node-local packing uses that).

    Longest-processing-time with a slot limit: replicas, heaviest first, each to the lightest
    GPU with a free slot that does not hold its expert. On skewed loads that is S rounds of G
    (round k hands the next G replicas to the GPUs in load order, one each), which the kernel
    runs while they agree; where the loads are flatter LPT lets light GPUs take several of
    the lighter replicas in a row, which leaves refine fewer swaps. A row LPT cannot finish (an
    expert with more replicas than GPUs with free slots left) is packed in rounds, which
    always fit.
    """
    return _pack_rows(_greedy_kernel, kernel_floats(per_LE), kernel_ints(count_LE), int(num_gpus), int(slots_per_gpu))


def _pack_rows(kernel, per_LE: np.ndarray, count_LE: np.ndarray, G: int, S: int) -> np.ndarray:
    """The packing kernel on kernel-typed arrays (see `pack_replicas`)."""
    # Heaviest first; numpy's sort is quicker than a compiled one, and the kernel orders ties by id.
    return kernel.pack(per_LE, count_LE, np.argsort(-per_LE, axis=1), G, S)


def _swap_cap(num_slots: int, max_rounds: int | None) -> int:
    """Swaps per row at most: max_rounds, or 4 x P when None (until no swap helps)."""
    return 4 * int(num_slots) if max_rounds is None else int(max_rounds)


def refine(phy2log_LP: np.ndarray, load_LE: np.ndarray | None, count_LE: np.ndarray | None, num_gpus: int,
           max_rounds: int | None = None, per_LE: np.ndarray | None = None, gap: float = 0.0) -> np.ndarray:
    """Lower each layer's busiest GPU by pairwise replica swaps (in place; returns phy2log_LP).

    Rows may be any batch (layers, or layers x nodes with G = GPUs per node). Each replica
    carries per_LE (default load_LE / count_LE, an even split). max_rounds: swaps per row at
    most, each the best (None: until no swap lowers the busiest GPU, at most 4 x P, each the
    first below the second-busiest GPU: planners/_greedy_kernel.py). gap: a row stops once its
    busiest GPU is within this fraction of its floor (0: no earlier; see REFINE_GAP).
    """
    if per_LE is None:
        per_LE = load_LE / count_LE
    phy = kernel_ints(phy2log_LP)
    cap = _swap_cap(phy.shape[1], max_rounds)
    if cap > 0:
        per_LE = kernel_floats(per_LE)
        kernel = _greedy_kernel
        settle = max_rounds is None
        run_blocks(lambda a, b: kernel.refine(phy[a:b], per_LE[a:b], int(num_gpus), cap, settle, float(gap)),
                   *phy.shape)
    if phy is not phy2log_LP:
        phy2log_LP[...] = phy
    return phy2log_LP


def check_shape(num_experts: int, num_gpus: int, slots_per_gpu: int) -> None:
    """Refuse topologies greedy cannot fill: fewer slots than experts, or more slots than one
    replica of every expert on every GPU."""
    P = num_gpus * slots_per_gpu
    if P < num_experts:
        raise EplbError(f"{num_gpus} GPUs x {slots_per_gpu} slots = {P} slots cannot hold {num_experts} experts")
    if P > num_gpus * num_experts:
        raise EplbError(f"{P} slots need more than one replica of an expert per GPU ({num_experts} experts, "
                        f"{num_gpus} GPUs)")


def plan_greedy(load_LE: np.ndarray, num_gpus: int, slots_per_gpu: int, refine_rounds: int | None = None,
                count_LE: np.ndarray | None = None, refine_gap: float = 0.0) -> np.ndarray:
    """The whole greedy plan: replicate, pack, refine (refine_rounds: swaps per layer at most;
    None: until no swap helps, 0: no refinement; refine_gap: stop within this fraction of the
    floor, 0: no earlier, see REFINE_GAP). Returns phy2log_LP. count_LE: `replicate`'s counts
    [L, E] when the caller already has them (they are what this would compute)."""
    load_LE = kernel_floats(load_LE)
    L, E = load_LE.shape
    G, S = int(num_gpus), int(slots_per_gpu)
    check_shape(E, G, S)
    P = G * S
    cap = _swap_cap(P, refine_rounds)
    gap = float(refine_gap)
    if count_LE is not None:
        count_LE = kernel_ints(count_LE)
    kernel = _greedy_kernel
    phy2log_LP = np.empty((L, P), dtype=np.int64)

    def rows(a: int, b: int) -> None:
        # The three steps on layers a..b-1 (every step is per layer: blocks give the same plan).
        load = load_LE[a:b]
        count = kernel.replicate(load, P, G) if count_LE is None else count_LE[a:b]
        per = load / count
        phy = _pack_rows(kernel, per, count, G, S)
        if cap > 0:
            kernel.refine(phy, per, G, cap, refine_rounds is None, gap)
        phy2log_LP[a:b] = phy

    run_blocks(rows, L, P)
    return phy2log_LP


class GreedyPlanner:
    """Replicate by load per replica, pack heaviest-first, refine by swaps; even dispatch.

    refine_rounds: busiest-GPU swaps per layer at most (None, the default: until no swap
    lowers the busiest GPU; 0: packing only, benchmarks/bench_greedy.py shows what each costs).
    refine_gap: refinement stops once a layer's busiest GPU is within this fraction of its
    floor (default REFINE_GAP, 0.1%; 0: until no swap helps).
    """

    name = "greedy"

    def __init__(self, refine_rounds: int | None = None, refine_gap: float = REFINE_GAP):
        self.refine_rounds = None if refine_rounds is None else whole_number("refine_rounds", refine_rounds)
        self.refine_gap = fraction("refine_gap", refine_gap, low_open=False, high_open=True)

    def plan(self, request: PlanRequest) -> Solution:
        t = request.topology
        return Solution(plan_greedy(request.load_LE, t.num_gpus, t.slots_per_gpu, self.refine_rounds,
                                    refine_gap=self.refine_gap))
