"""Exact placement with OR-Tools CP-SAT, one model per MoE layer, seeded by `greedy`.

Legend: L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU, P = G x S slots.

Each layer is one CP-SAT model (planners/ilp_model.py: the variables, integer loads and
hints), started from a complete hint: greedy's placement (with its exact LP shares for
`dispatch="weighted"`, or the wrap-around `chain_fill` placement where that is better; for
"even", greedy with its swap refinement where that is better). A hint that meets the analytic
lower bound is optimal as it is, and a solution that meets it ends the search. Layers are
solved concurrently in a thread pool (CP-SAT releases the GIL while it solves): `jobs` layers
at a time, `workers` CP-SAT threads each, largest gap first within one time budget. The plan
is scored on the real loads and each layer keeps the better of the CP-SAT and greedy
placements there: `ilp` is never worse than `greedy`.
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
from planners.ilp_model import RESOLUTION, scale_loads, solve_layer

DISPATCHES = ("weighted", "even")

_NO_ANSWER = {"objective": None, "bound": None, "seconds": 0.0, "hint_objective": None, "lower": None}


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
        load_LE = np.asarray(request.load_LE, dtype=np.float64)
        L, E = load_LE.shape
        if t.slots_per_gpu > E:
            raise EplbError(f"slots_per_gpu ({t.slots_per_gpu}) exceeds the {E} experts: the ilp planner holds "
                            f"at most one replica of an expert per GPU; use at most {E} slots per GPU")
        # Step 1: greedy, and the hints CP-SAT starts from.
        greedy, greedy_w_LP, hint_LP = self._hints(load_LE, t)
        # Step 2: the layers' models, largest gap to the lower bound first, in one time budget.
        lb_L = stats.lower_bound(load_LE, t.num_gpus, t.num_slots)
        results, errors, unreached = self._solve_layers(load_LE, t, hint_LP, greedy_w_LP, lb_L, started)
        # Step 3: score on the real loads; keep greedy in a layer where CP-SAT did not do better.
        phy2log_LP, weights_LP, final_max_L, greedy_max_L, keep_greedy = self._keep_better(
            load_LE, greedy, greedy_w_LP, results)
        # Step 4: report.
        info = self._info(results, errors, unreached, keep_greedy, final_max_L, greedy_max_L, lb_L, L)
        info["seconds"] = time.perf_counter() - started
        status, message = self._verdict(info, errors, L)
        return Solution(phy2log_LP, weights_LP, status, message, info)

    def _hints(self, load_LE: np.ndarray, topology):
        """(greedy placement, its exact LP shares (weighted) or None, hint phy2log_LP)."""
        G, S = topology.num_gpus, topology.slots_per_gpu
        E = load_LE.shape[1]
        greedy_LP = plan_greedy(load_LE, G, S)
        greedy = Placement(greedy_LP, G, E)
        if self.dispatch == "weighted":
            # Hint shares: the greedy placement's exact LP shares (integer loads are the real
            # ones scaled, so the same shares are optimal for them up to rounding).
            return greedy, optimal_weights(greedy, load_LE), greedy_LP
        # Even split: greedy's own swap refinement is a better start where it helps.
        refined_LP = plan_greedy(load_LE, G, S, refine_rounds=64)
        better_L = (Placement(refined_LP, G, E).gpu_loads(load_LE).max(axis=1)
                    < greedy.gpu_loads(load_LE).max(axis=1))
        return greedy, None, np.where(better_L[:, None], refined_LP, greedy_LP)

    def _solve_layers(self, load_LE, topology, hint_LP, hint_w_LP, lb_L, started: float):
        """Every layer's CP-SAT result (a dict, `solve_layer`'s), the layers whose solve raised
        (index -> message) and those not reached in time (they keep their hint)."""
        G = topology.num_gpus
        L, E = load_LE.shape
        int_LE = np.stack([scale_loads(load_LE[l]) for l in range(L)])
        jobs, workers = self._threads(L)
        results: list[dict] = [{}] * L
        errors: dict[int, str] = {}
        # Largest gap first; a layer whose hint meets the bound needs no search (solve_layer
        # returns at once), so it gets no share of the budget.
        hint_max_L = Placement(hint_LP, G, E).gpu_loads(load_LE).max(axis=1)
        hint_gap_L = np.where(lb_L > 0, hint_max_L / np.where(lb_L > 0, lb_L, 1.0) - 1.0, 0.0)
        todo = [l for l in np.argsort(-hint_gap_L, kind="stable").tolist() if int_LE[l].sum() > 0]
        for l in range(L):
            if int_LE[l].sum() == 0:
                results[l] = {"status": "OPTIMAL", "phy2log_P": hint_LP[l], "objective": 0, "bound": 0,
                              "seconds": 0.0, "hint_objective": 0, "lower": 0, "hint": "greedy"}
        deadline = started + self.time_limit
        weight_L = np.maximum(hint_gap_L, 1e-6)            # a layer at the bound still runs its check

        def limit(l: int, waiting: list[int]) -> float:
            """Layer l's share of the time left: the jobs' time over the layers not yet done."""
            left = deadline - time.perf_counter()
            share = weight_L[l] / (weight_L[l] + weight_L[waiting].sum())
            return max(0.05, left * min(1.0, jobs * share))

        unreached: list[int] = []
        bar = Progress(len(todo), f"ilp ({L} layers, {self.time_limit:g} s)", enabled=False if self.quiet else None)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures: dict = {}

            def submit():
                while todo and len(futures) < jobs:
                    if time.perf_counter() >= deadline:
                        unreached.extend(todo)
                        todo.clear()
                        return
                    l = todo.pop(0)
                    futures[pool.submit(solve_layer, int_LE[l], hint_LP[l],
                                        None if hint_w_LP is None else hint_w_LP[l], topology, self.dispatch,
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
                        results[l] = {**_NO_ANSWER, "status": "ERROR", "phy2log_P": None, "hint": None}
                    bar.update(1)
                submit()
        bar.close()
        for l in unreached:
            # Not searched in time: the hint, with its gap to the analytic bound (still proven).
            results[l] = {**_NO_ANSWER, "status": "NOT_SEARCHED", "phy2log_P": hint_LP[l], "hint": "greedy"}
        return results, errors, sorted(unreached)

    def _keep_better(self, load_LE, greedy: Placement, greedy_w_LP, results):
        """The plan: per layer CP-SAT's answer (or its hint when it gave none), greedy where that
        scores better on the real loads. Returns (phy2log_LP, weights_LP, busiest GPU [L] of the
        plan and of greedy, bool [L] where greedy was kept)."""
        phy2log_LP = greedy.phy2log_LP.copy()
        for l, r in enumerate(results):
            if r["phy2log_P"] is not None:
                phy2log_LP[l] = r["phy2log_P"]
            elif r.get("hint_phy2log_P") is not None:
                phy2log_LP[l] = r["hint_phy2log_P"]
        cand = Placement(phy2log_LP, greedy.num_gpus, greedy.num_logical_experts)
        cand_w_LP = optimal_weights(cand, load_LE) if greedy_w_LP is not None else None
        cand_max_L = cand.gpu_loads(load_LE, cand_w_LP).max(axis=1)
        greedy_max_L = greedy.gpu_loads(load_LE, greedy_w_LP).max(axis=1)
        keep_greedy = cand_max_L > greedy_max_L
        phy2log_LP[keep_greedy] = greedy.phy2log_LP[keep_greedy]
        weights_LP = None if cand_w_LP is None else np.where(keep_greedy[:, None], greedy_w_LP, cand_w_LP)
        return phy2log_LP, weights_LP, np.minimum(cand_max_L, greedy_max_L), greedy_max_L, keep_greedy

    def _info(self, results, errors, unreached, keep_greedy, final_max_L, greedy_max_L, lb_L, L: int) -> dict:
        """Solution.info: per layer status, proven gap, bound ratios, seconds, hint source."""
        jobs, workers = self._threads(L)
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
        solved = [r["phy2log_P"] is not None for r in results]
        info = {
            "dispatch": self.dispatch, "time_limit": self.time_limit, "jobs": jobs, "workers": workers,
            "seed": self.seed, "resolution": RESOLUTION,
            "status_L": [r["status"] for r in results],
            "gap_L": gap_L,
            "gap_max": max((g for g in gap_L if g is not None), default=None),
            "bound_ratio_L": [float(m / b) if b > 0 else 1.0 for m, b in zip(final_max_L, lb_L)],
            "greedy_bound_ratio_L": [float(m / b) if b > 0 else 1.0 for m, b in zip(greedy_max_L, lb_L)],
            "seconds_L": [float(r["seconds"]) for r in results],
            "hint_L": [r["hint"] for r in results],
            "searched_layers": int(sum(r["hint_objective"] is not None and r["hint_objective"] > (r["lower"] or 0)
                                       for r in results)),
            "kept_greedy_layers": [int(l) for l in np.flatnonzero(keep_greedy)],
            "fallback_layers": sorted(errors),
            "unanswered_layers": [l for l in range(L) if not solved[l] and l not in errors],
            "unreached_layers": list(unreached),
        }
        if errors:
            info["errors"] = {str(l): m for l, m in errors.items()}
        return info

    def _verdict(self, info: dict, errors: dict, L: int) -> tuple[str, str]:
        """(status, message) of the plan."""
        failed, unanswered, unreached = info["fallback_layers"], info["unanswered_layers"], info["unreached_layers"]
        proven = sum(s == "OPTIMAL" for s in info["status_L"])
        if failed:
            why = "; ".join(f"layer index {l}: {errors[l]}" for l in failed[:5])
            status = "FALLBACK"
            message = f"CP-SAT failed in {len(failed)} of {L} layers ({why}); those layers keep greedy's placement"
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
        if info["kept_greedy_layers"]:
            message += (f"; greedy kept in {len(info['kept_greedy_layers'])} layer(s) where it scored "
                        f"better on the real loads")
        return status, message
