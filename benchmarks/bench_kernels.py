"""Compiled kernels against whole-array numpy versions on the serving calls they sit on (issue 34).

    EPLB_JIT=wait python benchmarks/bench_kernels.py [--repeats 7] [--write-docs]

Legend: L = MoE layers, E = logical experts, G = GPUs, N = nodes, S = slots per GPU.

A kernel stays only where it pays on a serving path. Each case times one serving call with the
kernel and with the numpy version patched in, medians of --repeats calls in one run (the two
interleaved per case, so other jobs on the machine touch both columns alike), and says whether
the two give the same result. The numpy versions are tests/oracles/ (greedy.py, repair.py,
search.py, migration.py), which the tests check against the kernels. Workload: the DeepSeek-V3 shape of
traces/deepseek.npz (58 x 256), served = the greedy plan of the trace's first half, load (or the
windows the policy observes) = its second half; 32 GPUs on 4 nodes, 9 slots per GPU, unless a
row names another shape.
- `policy`: the Rebalancer's default decision, `AdaptivePolicy.decide` on 16 observed windows
  (eplb/serving/_policy_kernel.py, _swaps_kernel.py: the repair and the window scores);
- `greedy`: `eplb.plan(planner="greedy")`, the target of the policy=None decision and of the
  adaptive policy's replan (planners/_greedy_kernel.py, _pack_kernel.py), whole and per step;
- `search`: the policy=None decision, `eplb.plan(previous=, budget=)` (eplb/migration/_search_kernel.py,
  _price_kernel.py: the move-budgeted search), at 32-256 GPUs, on the Rebalancer's budget when
  given none ("default": move_cost=0.001), with DeepSeek-V3's 8 expert groups passed ("8
  groups": group span priced), and on a capped budget ("capped": max_moves 464, move_cost 0.05);
- `moves`: the move counting and GPU matching (eplb/migration/_moves_kernel.py) on the serving
  calls that use them: the Rebalancer's default decision (also on drifted traffic, where it
  bounds and renames fresh plans), the policy=None decision and vLLM's slot keeping.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _report import _machine, command_line, write_results  # noqa: E402

import eplb  # noqa: E402

SHAPES = [(32, 9, 4), (64, 5, 8), (128, 3, 16), (256, 2, 32)]
"""(GPUs, slots per GPU, nodes) of the greedy rows: DeepSeek-V3's 256 experts on 32 to 256 GPUs."""


def _trace():
    tr = eplb.load_trace(ROOT / "traces" / "deepseek.npz")
    counts = np.asarray(tr.counts_TLE, dtype=np.float64)
    return counts, counts.shape[0] // 2


def _workload(G=32, S=9, N=4):
    """(load of the decision [L, E], the served placement, the topology)."""
    counts, half = _trace()
    topo = eplb.Topology(num_gpus=G, slots_per_gpu=S, num_nodes=N)
    served = eplb.plan(counts[:half].sum(axis=0), topology=topo, planner="greedy").placement
    return counts[half:].sum(axis=0), served, topo


CAPPED = eplb.Budget(max_moves=58 * 8, move_cost=0.05)
"""A capped budget: 8 moves a layer on average, each to buy 5% of its layer's mean GPU load."""


def _decide(load, served, topo, num_expert_groups=None, budget=CAPPED):
    """The policy=None decision: a budgeted plan from the served placement."""
    return eplb.plan(load, topology=topo, planner="greedy", previous=served, budget=budget,
                     num_expert_groups=num_expert_groups)


def _pair(kernel_fn, numpy_fn, repeats):
    """(median s with the kernel, with numpy, their results), the two interleaved call by call."""
    kernel_fn(), numpy_fn()                    # warm: compiled code loaded, caches filled
    tk, tn = [], []
    for _ in range(repeats):
        for fn, ts in ((kernel_fn, tk), (numpy_fn, tn)):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return statistics.median(tk), statistics.median(tn), kernel_fn(), numpy_fn()


def _patched(targets, fn):
    """fn run with each (module, name, value) of targets patched in."""
    def run():
        saved = [(m, n, getattr(m, n)) for m, n, _ in targets]
        for m, n, v in targets:
            setattr(m, n, v)
        try:
            return fn()
        finally:
            for m, n, v in saved:
                setattr(m, n, v)
    return run


def _search_rows(repeats):
    from eplb.migration import adapt
    from eplb.serving.rebalance import DEFAULT_BUDGET
    from tests.oracles import search as numpy_search

    rows = []
    for G, S, N in SHAPES:
        load, served, topo = _workload(G, S, N)
        for budget, groups, what in ((DEFAULT_BUDGET, None, "default budget"), (DEFAULT_BUDGET, 8, "default, 8 groups"),
                                     (CAPPED, None, "capped budget")):
            def decide(load=load, served=served, topo=topo, groups=groups, budget=budget):
                return _decide(load, served, topo, groups, budget).solution.phy2log_LP

            tk, tn, a, b = _pair(decide, _patched([(adapt, "budgeted_search", numpy_search.budgeted_search)], decide),
                                 repeats)
            rows.append(("search + price (eplb/migration/_search_kernel.py, _price_kernel.py)",
                         f"policy=None decision, {G} GPUs x {S} slots, {N} nodes, {what}", tk, tn,
                         np.array_equal(a, b)))
    return rows


def _policy_rows(repeats):
    from eplb.serving import adaptive, replan
    from eplb.serving.adaptive import AdaptivePolicy
    from tests.oracles import repair as numpy_repair

    counts, half = _trace()
    load, served, topo = _workload()
    pol = AdaptivePolicy()
    for w in counts[half:]:
        pol.observe(w, served)
    # Each call decides on a copy of the policy (a decision clears the detector's flags);
    # the copy is part of both columns (about a millisecond).
    decide = lambda: copy.deepcopy(pol).decide(served).phy2log_LP  # noqa: E731
    numpy_decide = _patched([(adaptive, "repair", numpy_repair.repair),
                             (adaptive, "window_imbalance", numpy_repair.window_imbalance),
                             (replan, "window_imbalance", numpy_repair.window_imbalance)], decide)
    tk, tn, a, b = _pair(decide, numpy_decide, repeats)
    return [("policy: repair + window scores (eplb/serving/_policy_kernel.py, _swaps_kernel.py)",
             "Rebalancer default decision (AdaptivePolicy.decide, 16 windows)", tk, tn, np.array_equal(a, b))]


def _greedy_rows(repeats):
    from planners import greedy
    from tests.oracles import greedy as numpy_greedy

    rows = []
    counts, half = _trace()
    for G, S, N in SHAPES:
        load, served, topo = _workload(G, S, N)
        def whole(load=load, topo=topo):
            return eplb.plan(load, topology=topo, planner="greedy").placement.phy2log_LP

        tk, tn, a, b = _pair(whole, _patched([(greedy, "plan_greedy", numpy_greedy.plan_greedy)], whole), repeats)
        rows.append(("greedy: replicate + pack + refine (planners/_greedy_kernel.py, _pack_kernel.py)",
                     f"eplb.plan(planner='greedy'), {G} GPUs x {S} slots", tk, tn, np.array_equal(a, b)))
        if G == 32:
            def decide(load=load, served=served, topo=topo):
                return _decide(load, served, topo).solution.phy2log_LP

            tk, tn, a, b = _pair(decide, _patched([(greedy, "plan_greedy", numpy_greedy.plan_greedy)], decide),
                                 repeats)
            rows.append(("greedy (the same)", "policy=None decision (budgeted plan), 32 GPUs", tk, tn,
                         np.array_equal(a, b)))
    load, served, topo = _workload()
    G, S, P = 32, 9, 288
    count = greedy.replicate(load, P, G)
    per = load / count
    packed = greedy.pack_replicas(per, count, G, S)
    steps = {"replicate": (lambda: greedy.replicate(load, P, G), lambda: numpy_greedy.replicate(load, P, G)),
             "pack": (lambda: greedy.pack_replicas(per, count, G, S), lambda: numpy_greedy.pack(per, count, G, S)),
             "refine": (lambda: greedy.refine(packed.copy(), None, None, G, per_LE=per, gap=greedy.REFINE_GAP),
                        lambda: _np_refine(numpy_greedy, packed, per, G, P))}
    for name, (k, n) in steps.items():
        tk, tn, a, b = _pair(k, n, repeats)
        rows.append((f"greedy step {name}", "one call, 32 GPUs x 9 slots", tk, tn, np.array_equal(a, b)))
    return rows


def _np_refine(numpy_greedy, packed, per, G, P):
    from planners.greedy import REFINE_GAP

    phy = packed.copy()
    numpy_greedy.refine(phy, per, G, 4 * P, True, REFINE_GAP)
    return phy


MOVES = {"count_moves": ("count_moves",), "keep_slots": ("keep_slots",),
         "relabel": ("keep_counts", "gpu_assignment", "keep_pairs"), "fewest_moves": ("fewest_moves",),
         "rename_gpus": ("rename_gpus", "match_gpus")}
"""The kernels of eplb/migration/_moves_kernel.py by the public function of eplb.migration.moves
they serve; their numpy twins are tests/oracles/moves_numpy.py (same arguments)."""


def _with_numpy_moves(fn, uses):
    """fn run with the move kernels of the functions `uses` replaced by their numpy twins."""
    from eplb.migration import _moves_kernel
    from tests.oracles import moves_numpy

    return _patched([(_moves_kernel, k, getattr(moves_numpy, k)) for u in uses for k in MOVES[u]], fn)


def _drifted_policy(G, S, N):
    """An AdaptivePolicy that has observed the second half of the trace while serving a plan of the
    first half with its experts renamed (a shift every layer sees), and that served placement:
    its decision offers fresh plans, so it bounds (fewest_moves) and renames them too."""
    from eplb.serving.adaptive import AdaptivePolicy

    counts, half = _trace()
    topo = eplb.Topology(num_gpus=G, slots_per_gpu=S, num_nodes=N)
    served = eplb.plan(np.roll(counts[:half].sum(axis=0), 97, axis=1), topology=topo, planner="greedy").placement
    pol = AdaptivePolicy()
    for w in counts[half:]:
        pol.observe(w, served)
    return pol, served


def _moves_rows(repeats):
    from eplb.migration import moves
    from eplb.serving.adaptive import AdaptivePolicy
    from eplb.serving.rebalance import DEFAULT_BUDGET

    counts, half = _trace()
    rows = []
    for G, S, N in ((32, 9, 4), (256, 2, 32), (256, 2, 1)):
        load, served, topo = _workload(G, S, N)
        pol = AdaptivePolicy()
        for w in counts[half:]:
            pol.observe(w, served)
        drift, drift_served = _drifted_policy(G, S, N)
        new = _decide(load, served, topo).solution.phy2log_LP
        old = served.phy2log_LP
        drift_uses = ("count_moves", "fewest_moves", "relabel" if N > 1 else "rename_gpus")
        calls = {
            "Rebalancer default decision (AdaptivePolicy.decide, 16 windows)":
                (lambda pol=pol, served=served: copy.deepcopy(pol).decide(served).phy2log_LP, drift_uses),
            "the same on drifted traffic (fresh plans bounded and renamed)":
                (lambda pol=drift, served=drift_served: copy.deepcopy(pol).decide(served).phy2log_LP, drift_uses),
            "policy=None decision, default budget":
                (lambda load=load, served=served, topo=topo: _decide(load, served, topo, None,
                                                                     DEFAULT_BUDGET).solution.phy2log_LP,
                 ("count_moves", "keep_slots", "relabel")),
            "policy=None decision, capped budget":
                (lambda load=load, served=served, topo=topo: _decide(load, served, topo).solution.phy2log_LP,
                 ("count_moves", "keep_slots", "relabel")),
            "vLLM preserve_intragpu_slots":
                (lambda old=old, new=new, G=G: np.take_along_axis(new, eplb.migration.keep_slots(old, new, G), axis=1),
                 ("keep_slots",)),
        }
        # The replan's renaming is reached only where a fresh plan beats the repair by its gap
        # and the bound on its moves: none of the decisions above; timed here on every layer.
        fresh = eplb.plan(load, topology=topo, planner="greedy").placement.phy2log_LP
        calls["one call, every layer: fewest_moves"] = (
            lambda old=old, fresh=fresh, G=G: moves.fewest_moves(old, fresh, G, 256), ("fewest_moves",))
        calls["one call, every layer: rename_gpus"] = (
            lambda old=old, fresh=fresh, G=G: moves.rename_gpus(old, fresh, G, 256), ("rename_gpus",))
        for what, (fn, uses) in calls.items():
            # Every function the call uses in numpy, then each alone (the others compiled).
            for numpy_names in (uses, *((u,) for u in uses)) if len(uses) > 1 else (uses,):
                tk, tn, a, b = _pair(fn, _with_numpy_moves(fn, numpy_names), repeats)
                label = "all" if len(numpy_names) > 1 else numpy_names[0]
                rows.append((f"moves: {label} (eplb/migration/_moves_kernel.py)",
                             f"{what}, {G} GPUs x {S} slots, {N} nodes", tk, tn, bool(np.array_equal(a, b))))
    return rows


REMOVED = """\
Removed kernels (the row was measured by this script at the commit named, where it still ran
both; the numpy version is now the one implementation):

| kernel | serving call | with kernel (ms) | with numpy (ms) | numpy / kernel | same plan |
|---|---|---:|---:|---:|---|
| best_swap (eplb/migration/_repair_kernel.py), at 9ea33ac | policy=None decision, SGLang static rule \
| 5144.1 | 5115.4 | 0.99 | True |
"""


VERDICT = """\
What stays and what went:
- Kept: the adaptive policy's `_policy_kernel` + `_swaps_kernel`. The Rebalancer's default
  decision is an order of magnitude slower with numpy (its swap rounds price every candidate
  pair on every window, and the fill moves one replica at a time), the decision a serving
  loop waits on every window.
- Kept: greedy's `_greedy_kernel` + `_pack_kernel`. greedy is the planner behind the policy=None
  decision, the adaptive policy's replan, failed-rank plans and `eplb plan -p greedy`; numpy is
  20-180x slower on the whole plan (refine, one swap per step, most of it) and would put the
  greedy target (>= 25x faster than SGLang's plan, docs/results/speed.md) out of reach.
- Kept: `_moves_kernel`, every function of it (the `moves` rows: the fastest numpy / scipy
  found, tests/oracles/moves_numpy.py, on each serving call that uses the module, all of it and
  each function alone in numpy). Per call numpy is 5-22x slower: count_moves about 0.3 ms more
  at 32 GPUs and 1 ms at 256, keep_slots 1-4 ms, relabel's per-block scipy matchings 8 ms at 32
  GPUs. On the Rebalancer's default decision count_moves runs once and the bound only on the
  layers offered a fresh plan: a millisecond or less, about the noise of these rows. The
  policy=None decision runs count_moves 3-5 times, keep_slots twice and relabel once: 25-200%
  slower with all of them in numpy, up to 70% with count_moves or keep_slots alone and 15-140% with
  relabel alone at 32 and 256 GPUs on 32 nodes (on one node at 256 GPUs relabel's matching is
  scipy's either way and only keep_pairs differs, about 3 ms of a 25 ms relabel); vLLM's slot
  keeping is 4-15x slower. The bound (`fewest_moves`) and the greedy renaming (`rename_gpus`)
  serve only the replan: 7-22x and 14-22x slower per call on every layer, and the renaming is
  reached by no decision here (the bound stops every fresh plan first). The bound is the one
  near the line: 0.1 ms more on the default decision, 0.4-1.1 ms on drifted traffic (15-19
  layers bounded), over the 1 ms allowed at 256 GPUs, for 33 kernel lines. Removing the whole
  module (437 lines) would have brought the kernels to 14.9% of the package.
- Kept: the schedule's six (33 ms vs 265 ms, a 1.2 ms vs 75 ms stall of the serving thread:
  docs/results/speed.md).
- Kept: the search's `_search_kernel` + `_price_kernel`. They sit on the policy=None decision
  (min_improvement, failed ranks; the Rebalancer's default decides through the policy above,
  and under the SGLang rule the search is noise beside the 5 s repair), where numpy takes
  about 4x the decision's time on the Rebalancer's default budget at 32-128 GPUs and 2.5x at
  256 (1.3-2.2x on the capped budget): more than a serving decision may lose. Removing them
  (573 lines) is the one way found to bring the kernels under 15% of the package, a trade
  measured here, not made (commit d85b369 makes it).
- Removed earlier: `_repair_kernel` (0.99x, the row above).
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--only", choices=("policy", "greedy", "search", "moves"), action="append")
    a = ap.parse_args(argv)
    started = _machine()
    groups = {"policy": _policy_rows, "greedy": _greedy_rows, "search": _search_rows, "moves": _moves_rows}
    rows = [r for name, f in groups.items() if not a.only or name in a.only for r in f(a.repeats)]
    lines = ["| kernel | serving call | with kernel (ms) | with numpy (ms) | numpy / kernel | same result |",
             "|---|---|---:|---:|---:|---|"]
    for name, path, k, n, same in rows:
        lines.append(f"| {name} | {path} | {k * 1e3:.2f} | {n * 1e3:.2f} | {n / k:.2f} | {same} |")
    text = "\n".join(lines) + "\n\n" + REMOVED
    print(text)
    if a.write_docs:
        head = (f"# Kernels: kept where they pay on a serving call (issue 34)\n\n"
                f"Written by `{command_line(argv)}`; start: {started}; end: {_machine()}. Timings on a shared "
                f"machine are upper bounds: read the ratios.\n\n")
        write_results("kernels", head + __doc__.split("\n\n", 2)[2].strip() + "\n\n" + text + "\n" + VERDICT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
