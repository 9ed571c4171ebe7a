"""Exact placement with OR-Tools CP-SAT, one model per MoE layer, seeded by `greedy`.

Legend: L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU, P = G x S slots.

The model (per layer; `dispatch="weighted"`, the default):
  x[e, g]  bool   expert e has a replica on GPU g (at most one per GPU: two copies on one
                  GPU never lower that GPU's load)
  f[e, g]  int    tokens of expert e served by its replica on GPU g
  z        int    the busiest GPU's load, minimised
With `dispatch="even"` (engines that split an expert's tokens evenly among its replicas), the
shares are not free: r[e] = number of replicas, and every replica of e serves load_e / r[e]
(a table lookup on r[e], so the model is exact, not linearised).

Loads are scaled to integers per layer: load_e x RESOLUTION / layer total, rounded to the
nearest integer (the layer's total becomes ~2^24, so one unit is ~2e-6 of a GPU's mean load
at 32 GPUs and rounding moves a GPU's load by at most S/2 units). Even-split per-replica
loads are rounded up. The plan is scored afterwards on the real loads, and each layer keeps
the better of the CP-SAT and greedy placements there: `ilp` is never worse than `greedy`.

Every variable gets a hint (a complete solution): from `greedy`; for "weighted" with the
exact LP shares of the greedy placement rounded to integers that sum to each expert's load,
or the wrap-around `chain_fill` placement where that is better; for "even", greedy with its
swap refinement where that is better. z >= the analytic lower bound (`eplb.stats.lower_bound`),
so a hint that meets the bound is optimal as it is (CP-SAT is then skipped) and a solution
that meets it ends the search. Layers are solved concurrently in a thread pool (CP-SAT
releases the GIL while it solves): `jobs` layers at a time, `workers` CP-SAT threads each.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import numpy as np

from eplb import stats
from eplb.core.placement import Placement
from eplb.core.progress import Progress
from eplb.dispatch.rules import optimal_weights
from eplb.errors import EplbError
from planners.api import PlanRequest, Solution
from planners.greedy import plan_greedy

RESOLUTION = 1 << 24
"""Scaled total load of one layer, in integer units."""

DISPATCHES = ("weighted", "even")


def scale_loads(load_E: np.ndarray) -> np.ndarray:
    """Integer loads [E] summing to ~RESOLUTION (0 stays 0; any positive load stays >= 1)."""
    total = float(load_E.sum())
    if total <= 0:
        return np.zeros(load_E.shape, dtype=np.int64)
    scaled = np.rint(load_E * (RESOLUTION / total)).astype(np.int64)
    return np.where(load_E > 0, np.maximum(scaled, 1), 0)


def integer_shares(load_E: np.ndarray, phy2log_P: np.ndarray, weights_P: np.ndarray) -> np.ndarray:
    """Round per-slot token amounts to integers that sum to each expert's integer load.

    Largest-remainder rounding per expert: floor every share, then hand the missing units to
    the replicas with the largest fractional parts.
    """
    exact_P = load_E[phy2log_P] * weights_P
    out_P = np.floor(exact_P).astype(np.int64)
    short_E = load_E - np.bincount(phy2log_P, weights=out_P, minlength=load_E.size).astype(np.int64)
    order = np.lexsort((-(exact_P - out_P), phy2log_P))  # by expert, then largest remainder first
    rank = np.empty_like(order)
    starts = np.searchsorted(phy2log_P[order], phy2log_P[order])
    rank[order] = np.arange(order.size) - starts
    out_P += rank < short_E[phy2log_P]
    return out_P


def balanced_groups(load_E: np.ndarray, num_gpus: int, passes: int = 4) -> list[list[int]]:
    """Split experts into G groups of E // G or E // G + 1 with near-equal total loads.

    Heaviest expert to the lightest group, one expert per group per round; then pairwise
    swaps (heaviest groups against lightest) that lower the two groups' squared deviation.
    """
    E, G = load_E.size, num_gpus
    w = load_E.astype(np.float64)
    order = np.argsort(-w, kind="stable")
    members: list[list[int]] = [[] for _ in range(G)]
    sums = np.zeros(G)
    for start in range(0, E, G):
        batch = order[start:start + G]
        for e, g in zip(batch, np.argsort(sums, kind="stable")[:len(batch)]):
            members[g].append(int(e))
            sums[g] += w[e]
    mean = w.sum() / G
    for _ in range(passes):
        improved = False
        by_sum = np.argsort(-sums)
        for gh in by_sum[: G // 2]:
            for gl in by_sum[::-1][: G // 2]:
                if gh == gl:
                    continue
                a, b = np.array(members[gh]), np.array(members[gl])
                delta = w[a][:, None] - w[b][None, :]       # load moved from gh to gl
                cost = (sums[gh] - delta - mean) ** 2 + (sums[gl] + delta - mean) ** 2
                i, j = np.unravel_index(np.argmin(cost), cost.shape)
                if cost[i, j] < (sums[gh] - mean) ** 2 + (sums[gl] - mean) ** 2 - 1e-9 * mean * mean:
                    members[gh][i], members[gl][j] = int(b[j]), int(a[i])
                    sums[gh] -= delta[i, j]
                    sums[gl] += delta[i, j]
                    improved = True
        if not improved:
            break
    return members


def chain_fill(load_E: np.ndarray, num_gpus: int, slots_per_gpu: int, level: int, groups=None):
    """Wrap-around filling at a GPU load `level` (weighted dispatch): (phy2log_P, share_P) or None.

    McNaughton's wrap-around rule with slot limits, for integer loads:
    Step 1: split the experts into G groups of ~E/G with near-equal loads (`balanced_groups`;
            pass `groups` to reuse them across levels).
    Step 2: fill GPUs in turn up to `level`: GPU k gets the carry-over of GPU k - 1, then a
            group, its hottest expert last; that expert's overflow goes to a second replica
            opening GPU k + 1. The carry after GPU k is D_{k+1} = D_k + load(group) - level;
            the next group is the lightest one that keeps 0 <= D_{k+1} < its hottest expert
            (so that expert starts on GPU k and the next GPU still has room); when no group
            reaches `level` (it is above the mean), the heaviest that fits stays whole.
    Every GPU but the last is filled to exactly `level`, so at level = the lower bound the
    result is optimal. Needs E / G + 1 <= S (about one redundant slot per GPU); returns None
    when the slots or the level do not allow it. Spare slots get zero-share replicas of the
    hottest experts not already on that GPU (room for re-splitting later).
    """
    E, G, S = load_E.size, num_gpus, slots_per_gpu
    if -(-E // G) + 1 > S:
        return None
    order = np.argsort(-load_E, kind="stable")
    members = [list(m) for m in (groups if groups is not None else balanced_groups(load_E, G))]
    members = [sorted(m, key=lambda e: -int(load_E[e])) for m in members]
    sums = np.array([int(load_E[m].sum()) for m in members], dtype=np.int64)
    # Step 2: sequence the groups and fill.
    left = list(range(G))
    carry: tuple[int, int] | None = None
    d = 0
    gpu_items: list[list[tuple[int, int]]] = []
    for k in range(G):
        if k == G - 1:
            g = left[0]
            if d + int(sums[g]) > level:
                return None
        else:
            fits = [g for g in left if d + int(sums[g]) - level < int(load_E[members[g][0]])]
            over = [g for g in fits if d + int(sums[g]) >= level]
            if over:
                g = min(over, key=lambda g: int(sums[g]))
            elif fits:
                # Level above the mean: this GPU stays below it (no overflow, no carry).
                g = max(fits, key=lambda g: int(sums[g]))
            else:
                return None
        left.remove(g)
        items = [] if carry is None else [carry]
        *fillers, straddler = members[g][::-1]          # coldest first, hottest last
        items += [(e, int(load_E[e])) for e in fillers]
        if k == G - 1:
            items.append((straddler, int(load_E[straddler])))
        else:
            piece = min(int(load_E[straddler]), level - d - (int(sums[g]) - int(load_E[straddler])))
            items.append((straddler, piece))
            d = int(load_E[straddler]) - piece
            carry = (straddler, d) if d > 0 else None
        gpu_items.append(items)
    phy2log_P = np.empty(G * S, dtype=np.int64)
    share_P = np.zeros(G * S, dtype=np.int64)
    for g, items in enumerate(gpu_items):
        held = {e for e, _ in items}
        assert len(held) == len(items) <= S, "chain_fill broke a slot rule"
        spare = [int(e) for e in order if int(e) not in held][: S - len(items)]
        for j, (e, amount) in enumerate(items + [(e, 0) for e in spare]):
            phy2log_P[g * S + j] = e
            share_P[g * S + j] = amount
    return phy2log_P, share_P


def best_chain(load_E: np.ndarray, num_gpus: int, slots_per_gpu: int, lower: int, upper: int):
    """The lowest level in [lower, upper) at which chain_fill succeeds (bisection), or None."""
    groups = balanced_groups(load_E, num_gpus)
    best = chain_fill(load_E, num_gpus, slots_per_gpu, lower, groups)
    if best is not None:
        return best
    lo, hi = lower, upper                               # fails at lo; hi unknown
    for _ in range(12):
        if hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        got = chain_fill(load_E, num_gpus, slots_per_gpu, mid, groups)
        if got is None:
            lo = mid
        else:
            best, hi = got, mid
    return best


def integer_lower_bound(load_E: np.ndarray, num_gpus: int, num_slots: int) -> int:
    """`eplb.stats.lower_bound` for integer loads, exact: z >= ceil(total / G) and
    z >= ceil(load_e / r_e) for the replica counts r minimising the largest per-replica load."""
    r_E = stats.replica_counts_minmax(load_E[None].astype(np.float64), num_slots)[0]
    return max(-(-int(load_E.sum()) // num_gpus), max(-(-int(v) // int(r)) for v, r in zip(load_E, r_E)))


def solve_layer(load_E: np.ndarray, hint_phy2log_P: np.ndarray, hint_w_P: np.ndarray | None, num_gpus: int,
                slots_per_gpu: int, dispatch: str, time_limit: float, workers: int, seed: int,
                chain: bool = True) -> dict:
    """One layer's CP-SAT model: returns phy2log_P (or None), status, objective, bound, seconds.

    load_E: integer loads; hint_phy2log_P / hint_w_P: the greedy placement and (weighted) its LP
    shares. With `chain` (weighted only), the hint is the better of greedy and `best_chain`.
    A hint that meets the lower bound is optimal as it is: CP-SAT is then not run.
    """
    t0 = time.perf_counter()
    # Data.
    E, G, S = load_E.size, num_gpus, slots_per_gpu
    P = G * S
    all_experts, all_gpus = range(E), range(G)
    max_replicas = min(G, P - E + 1)
    gpu_P = np.arange(P) // S
    lower = integer_lower_bound(load_E, G, P)
    hint_source = "greedy"
    if dispatch == "weighted":
        hint_share_P = integer_shares(load_E, hint_phy2log_P, hint_w_P)
        greedy_z = int(hint_share_P.reshape(G, S).sum(axis=1).max())
        if chain and greedy_z > lower:
            got = best_chain(load_E, G, S, lower, greedy_z)
            if got is not None and int(got[1].reshape(G, S).sum(axis=1).max()) < greedy_z:
                hint_phy2log_P, hint_share_P = got
                hint_source = "chain"
        hint_z = int(hint_share_P.reshape(G, S).sum(axis=1).max())
    else:
        count_E = np.bincount(hint_phy2log_P, minlength=E)
        per_E = -(-load_E // count_E)
        hint_z = int(per_E[hint_phy2log_P].reshape(G, S).sum(axis=1).max())
    out = {"status": "OPTIMAL", "seconds": 0.0, "hint_objective": hint_z, "hint": hint_source,
           "lower": lower, "phy2log_P": hint_phy2log_P, "hint_phy2log_P": hint_phy2log_P, "objective": hint_z,
           "bound": lower}
    if hint_z <= lower:
        # The hint meets the analytic bound: proven optimal without search.
        out["seconds"] = time.perf_counter() - t0
        return out

    from ortools.sat.python import cp_model

    hint_x = np.zeros((E, G), dtype=bool)
    hint_x[hint_phy2log_P, gpu_P] = True
    hint_count_E = np.bincount(hint_phy2log_P, minlength=E)

    # Model.
    model = cp_model.CpModel()
    x = {}
    for e in all_experts:
        for g in all_gpus:
            x[e, g] = model.new_bool_var(f"x[{e},{g}]")
            model.add_hint(x[e, g], bool(hint_x[e, g]))

    # Each GPU holds exactly its slot count of experts (at most one replica of each).
    for g in all_gpus:
        model.add(sum(x[e, g] for e in all_experts) == S)

    # Every expert has at least one replica, and no more than there are GPUs or spare slots allow.
    for e in all_experts:
        model.add(sum(x[e, g] for g in all_gpus) >= 1)
        model.add(sum(x[e, g] for g in all_gpus) <= max_replicas)

    # Tokens on each replica (weighted: free integer shares; even: the expert's load / replicas).
    share = {}
    if dispatch == "weighted":
        hint_f = np.zeros((E, G), dtype=np.int64)
        hint_f[hint_phy2log_P, gpu_P] = hint_share_P
        for e in all_experts:
            for g in all_gpus:
                share[e, g] = model.new_int_var(0, int(load_E[e]), f"f[{e},{g}]")
                model.add_hint(share[e, g], int(hint_f[e, g]))
                # A GPU serves tokens of an expert only if it holds a replica of it.
                model.add(share[e, g] <= int(load_E[e]) * x[e, g])
        for e in all_experts:
            # An expert's replicas serve all of its tokens between them.
            model.add(sum(share[e, g] for g in all_gpus) == int(load_E[e]))
    else:
        for e in all_experts:
            le = int(load_E[e])
            # per_replica[e] = ceil(load_e / r_e): table entry k is for k replicas (k = 0 unused).
            table = [le] + [-(-le // k) for k in range(1, max_replicas + 1)]
            r = model.new_int_var(1, max_replicas, f"r[{e}]")
            per = model.new_int_var(min(table), le, f"per_replica[{e}]")
            model.add_hint(r, int(hint_count_E[e]))
            model.add_hint(per, table[hint_count_E[e]])
            # The number of replicas of an expert is the number of GPUs that hold it.
            model.add(sum(x[e, g] for g in all_gpus) == r)
            # Each replica of an expert serves an even share of its load.
            model.add_element(r, table, per)
            for g in all_gpus:
                share[e, g] = model.new_int_var(0, le, f"c[{e},{g}]")
                held = bool(hint_x[e, g])
                model.add_hint(share[e, g], table[hint_count_E[e]] if held else 0)
                # A GPU that holds the expert serves at least that share. (Only a lower bound is
                # needed: shares appear only in "GPU load <= z", which z minimises, so at the
                # optimum c = per_replica where x = 1 and 0 elsewhere; one linear row each.)
                model.add(share[e, g] >= per - le + le * x[e, g])
        hint_f = np.where(hint_x, (-(-load_E // np.maximum(hint_count_E, 1)))[:, None], 0)
    assert int(hint_f.sum(axis=0).max()) == hint_z, "hint out of step with its objective"

    # The busiest GPU's load is at least the analytic lower bound, and no worse than the hint.
    z = model.new_int_var(min(lower, hint_z), hint_z, "max_gpu_load")
    model.add_hint(z, hint_z)
    for g in all_gpus:
        # No GPU serves more tokens than the busiest GPU's load.
        model.add(sum(share[e, g] for e in all_experts) <= z)
    model.minimize(z)

    # Solve.
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_workers = int(workers)
    solver.parameters.random_seed = int(seed)
    # One presolve pass: on DeepSeek-V3 layers (16k variables) the default three can use up a
    # 12 s limit on a busy machine before the hint is even loaded.
    solver.parameters.max_presolve_iterations = 1
    status = solver.solve(model)
    out.update(status=solver.status_name(status), seconds=time.perf_counter() - t0, phy2log_P=None,
               objective=None, bound=None)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        held = np.array([[solver.boolean_value(x[e, g]) for g in all_gpus] for e in all_experts])
        # Slots of GPU g, in expert-id order.
        out["phy2log_P"] = np.concatenate([np.flatnonzero(held[:, g]) for g in all_gpus]).astype(np.int64)
        out["objective"] = int(solver.objective_value)
        out["bound"] = int(solver.best_objective_bound)
    return out


class IlpPlanner:
    """Exact placement per layer with CP-SAT (see the module docstring for the model).

    time_limit: wall-clock seconds for the whole plan, model building included (default 60).
      Layers are searched largest gap first (the hint's busiest GPU over the lower bound;
      layers whose hint meets the bound are optimal without a search), each given the time
      left shared over the layers still to search in proportion to their gaps; a layer not
      reached in time keeps its hint.
    workers: CP-SAT threads per layer (default: cores / jobs).
    jobs: layers solved at the same time (default: 2 on >= 2 cores; CP-SAT gains less from a
      second thread than a second layer gains from its own core, see benchmarks/bench_ilp.py).
    seed: CP-SAT random seed.
    dispatch: "weighted" (free per-replica shares; the plan carries dispatch weights) or
      "even" (every replica of an expert takes the same share).
    chain: (weighted) also try `chain_fill` and hint CP-SAT with whichever of it and greedy
      is better (False: always the greedy hint).
    quiet: no progress bar (it is shown on a terminal only anyway).
    """

    name = "ilp"

    def __init__(self, time_limit: float = 60.0, workers: int | None = None, jobs: int | None = None,
                 seed: int = 0, dispatch: str = "weighted", chain: bool = True, quiet: bool = False):
        if isinstance(time_limit, bool) or not (isinstance(time_limit, (int, float)) and time_limit > 0):
            raise EplbError(f"time_limit must be a positive number of seconds (for the whole plan), got {time_limit!r}")
        for name, value in (("workers", workers), ("jobs", jobs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
                raise EplbError(f"{name} must be a positive integer, got {value!r}")
        if dispatch not in DISPATCHES:
            raise EplbError(f"dispatch must be one of {', '.join(DISPATCHES)}, got {dispatch!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise EplbError(f"seed must be an integer, got {seed!r}")
        for name, value in (("chain", chain), ("quiet", quiet)):
            if not isinstance(value, (bool, np.bool_)):
                raise EplbError(f"{name} must be true or false, got {value!r}")
        self.time_limit = float(time_limit)
        self.workers = workers
        self.jobs = jobs
        self.seed = int(seed)
        self.dispatch = dispatch
        self.chain = bool(chain)
        self.quiet = bool(quiet)

    def _threads(self, num_layers: int) -> tuple[int, int]:
        cores = os.cpu_count() or 1
        jobs = self.jobs or max(1, min(num_layers, cores if self.workers is None else cores // self.workers))
        workers = self.workers or max(1, cores // jobs)
        return jobs, workers

    def plan(self, request: PlanRequest) -> Solution:
        started = time.perf_counter()
        t = request.topology
        G, S = t.num_gpus, t.slots_per_gpu
        load_LE = np.asarray(request.load_LE, dtype=np.float64)
        L, E = load_LE.shape
        if S > E:
            raise EplbError(f"slots_per_gpu ({S}) exceeds the {E} experts: the ilp planner holds at most "
                            f"one replica of an expert per GPU; use at most {E} slots per GPU")
        greedy_LP = plan_greedy(load_LE, G, S)
        greedy = Placement(greedy_LP, G, E)
        weighted = self.dispatch == "weighted"
        greedy_w_LP = optimal_weights(greedy, load_LE) if weighted else None
        int_LE = np.stack([scale_loads(load_LE[l]) for l in range(L)])
        hint_w_LP = None
        hint_LP = greedy_LP
        if not weighted:
            # Even split: greedy's own swap refinement is a better start where it helps.
            refined_LP = plan_greedy(load_LE, G, S, refine_rounds=64)
            better_L = (Placement(refined_LP, G, E).gpu_loads(load_LE).max(axis=1)
                        < greedy.gpu_loads(load_LE).max(axis=1))
            hint_LP = np.where(better_L[:, None], refined_LP, greedy_LP)
        if weighted:
            # Hint shares: the greedy placement's exact LP shares (integer loads are the real
            # ones scaled, so the same shares are optimal for them up to rounding).
            hint_w_LP = greedy_w_LP
        jobs, workers = self._threads(L)

        results: list[dict | None] = [None] * L
        errors: dict[int, str] = {}
        # Largest gap first; a layer whose hint meets the bound needs no search (solve_layer
        # returns at once), so it gets no share of the budget.
        hint_max_L = Placement(hint_LP, G, E).gpu_loads(load_LE).max(axis=1)
        lb_L = stats.lower_bound(load_LE, G, G * S)
        hint_gap_L = np.where(lb_L > 0, hint_max_L / np.where(lb_L > 0, lb_L, 1.0) - 1.0, 0.0)
        todo = [l for l in np.argsort(-hint_gap_L, kind="stable").tolist() if int_LE[l].sum() > 0]
        for l in range(L):
            if int_LE[l].sum() == 0:
                results[l] = {"status": "OPTIMAL", "phy2log_P": greedy_LP[l], "objective": 0, "bound": 0,
                              "seconds": 0.0, "hint_objective": 0, "lower": 0, "hint": "greedy"}
        deadline = started + self.time_limit
        weight_L = np.maximum(hint_gap_L, 1e-6)            # a layer at the bound still runs its check

        def limit(l: int, waiting: list[int]) -> float:
            """Layer l's share of the time left: the jobs' time over the layers not yet done."""
            left = deadline - time.perf_counter()
            share = weight_L[l] / (weight_L[l] + weight_L[waiting].sum())
            return max(0.05, left * min(1.0, jobs * share))

        unreached: list[int] = []
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures: dict = {}
            bar = Progress(len(todo), f"ilp ({L} layers, {self.time_limit:g} s)",
                           enabled=False if self.quiet else None)

            def submit():
                while todo and len(futures) < jobs:
                    if time.perf_counter() >= deadline:
                        unreached.extend(todo)
                        todo.clear()
                        return
                    l = todo.pop(0)
                    futures[pool.submit(solve_layer, int_LE[l], hint_LP[l],
                                        None if hint_w_LP is None else hint_w_LP[l], G, S, self.dispatch,
                                        limit(l, todo), workers, self.seed, self.chain)] = l

            submit()
            while futures:
                done, _ = wait(futures, return_when=FIRST_COMPLETED)
                for fut in done:
                    l = futures.pop(fut)
                    try:
                        results[l] = fut.result()
                    except Exception as exc:  # a solver crash on one layer must not lose the others
                        errors[l] = f"{type(exc).__name__}: {exc}"
                        results[l] = {"status": "ERROR", "phy2log_P": None, "objective": None, "bound": None,
                                      "seconds": 0.0, "hint_objective": None, "lower": None, "hint": None}
                    bar.update(1)
                submit()
            bar.close()
        for l in unreached:
            # Not searched in time: the hint, with its gap to the analytic bound (still proven).
            results[l] = {"status": "NOT_SEARCHED", "phy2log_P": hint_LP[l], "objective": None, "bound": None,
                          "seconds": 0.0, "hint_objective": None, "lower": None, "hint": "greedy"}

        # Score on the real loads; keep greedy in a layer where CP-SAT did not do better.
        # A layer where CP-SAT returned nothing keeps its hint (greedy or chain-fill).
        phy2log_LP = greedy_LP.copy()
        solved = np.array([r["phy2log_P"] is not None for r in results])
        for l, r in enumerate(results):
            if r["phy2log_P"] is not None:
                phy2log_LP[l] = r["phy2log_P"]
            elif r.get("hint_phy2log_P") is not None:
                phy2log_LP[l] = r["hint_phy2log_P"]
        cand = Placement(phy2log_LP, G, E)
        if weighted:
            cand_w_LP = optimal_weights(cand, load_LE)
            cand_max_L = cand.gpu_loads(load_LE, cand_w_LP).max(axis=1)
            greedy_max_L = greedy.gpu_loads(load_LE, greedy_w_LP).max(axis=1)
        else:
            cand_max_L = cand.gpu_loads(load_LE).max(axis=1)
            greedy_max_L = greedy.gpu_loads(load_LE).max(axis=1)
        keep_greedy = cand_max_L > greedy_max_L
        phy2log_LP[keep_greedy] = greedy_LP[keep_greedy]
        weights_LP = None
        if weighted:
            weights_LP = np.where(keep_greedy[:, None], greedy_w_LP, cand_w_LP)
        final_max_L = np.minimum(cand_max_L, greedy_max_L)

        status_L = [r["status"] for r in results]
        gap_L = []
        for r in results:
            if r["objective"] is None and r["hint_objective"] is None:
                gap_L.append(None)
            else:
                # No CP-SAT answer: the hint's gap to the analytic bound is still proven.
                obj = r["hint_objective"] if r["objective"] is None else r["objective"]
                bound = r["lower"] if r["bound"] is None else max(r["bound"], r["lower"])
                gap_L.append(0.0 if obj == 0 else max(0.0, (obj - bound) / obj))
        # A layer CP-SAT gave no answer for within its share of the budget (at DeepSeek-V3 shape
        # the even model often does not get past presolve) keeps its complete hint, whose gap to
        # the analytic bound is proven: the same as a layer not reached in time. Only a solver
        # error is a failure of the plan.
        failed = [l for l in range(L) if not solved[l] and l in errors]
        unanswered = [l for l in range(L) if not solved[l] and l not in errors]
        info = {
            "dispatch": self.dispatch,
            "time_limit": self.time_limit,
            "jobs": jobs,
            "workers": workers,
            "seed": self.seed,
            "resolution": RESOLUTION,
            "status_L": status_L,
            "gap_L": gap_L,
            "gap_max": max((g for g in gap_L if g is not None), default=None),
            "bound_ratio_L": [float(m / b) if b > 0 else 1.0 for m, b in zip(final_max_L, lb_L)],
            "greedy_bound_ratio_L": [float(m / b) if b > 0 else 1.0 for m, b in zip(greedy_max_L, lb_L)],
            "seconds_L": [float(r["seconds"]) for r in results],
            "hint_L": [r["hint"] for r in results],
            "searched_layers": int(sum(r["hint_objective"] is not None and r["hint_objective"] > (r["lower"] or 0)
                                       for r in results)),
            "kept_greedy_layers": [int(l) for l in np.flatnonzero(keep_greedy)],
            "fallback_layers": failed,
            "unanswered_layers": unanswered,
            "unreached_layers": sorted(unreached),
            "seconds": time.perf_counter() - started,
        }
        if errors:
            info["errors"] = {str(l): m for l, m in errors.items()}
        proven = sum(s == "OPTIMAL" for s in status_L)
        if failed:
            status = "FALLBACK"
            why = "; ".join(f"layer index {l}: {errors[l]}" for l in failed[:5])
            message = (f"CP-SAT failed in {len(failed)} of {L} layers ({why}); those layers keep greedy's "
                       f"placement")
        elif proven == L:
            status, message = "OPTIMAL", f"all {L} layers proven optimal ({self.dispatch} dispatch)"
        else:
            status = "FEASIBLE"
            gap = "" if info["gap_max"] is None else f"; largest proven gap {100 * info['gap_max']:.3f}%"
            message = (f"{proven} of {L} layers proven optimal{gap} ({self.dispatch} dispatch, "
                       f"{self.time_limit:g} s plan)")
        if unanswered:
            message += (f"; CP-SAT gave no answer in its share of the budget in {len(unanswered)} layer(s), "
                        f"which keep their hint (greedy or chain-fill; raise time_limit)")
        if unreached:
            message += (f"; {len(unreached)} layer(s) not reached in the time budget keep the greedy hint "
                        f"(raise time_limit)")
        if len(info["kept_greedy_layers"]):
            message += (f"; greedy kept in {len(info['kept_greedy_layers'])} layer(s) where it scored "
                        f"better on the real loads")
        return Solution(phy2log_LP, weights_LP, status, message, info)
