"""Compiled kernels against their numpy versions on the serving path (issue 34), side by side.

    EPLB_JIT=wait python benchmarks/bench_kernels.py [--repeats 7] [--write-docs]

Legend: L = MoE layers, E = logical experts, G = GPUs, N = nodes, S = slots per GPU.

A kernel stays only where it pays on a serving path: Rebalancer.rebalance's decision, timed
here through the call it makes (`eplb.plan(previous=, budget=, dispatch=)`) on the DeepSeek-V3
shape of the shipped trace (58 x 256, 32 GPUs on 4 nodes, 9 slots per GPU), the served
placement the greedy plan of the trace's first half, the load its second half. Each case runs
the same call with the kernel and with the numpy version patched in (the numpy versions are the
test oracles in tests/oracles/, which the tests check slot by slot against the kernels);
medians of --repeats calls in one run, so other jobs on the machine touch both columns alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import eplb  # noqa: E402
from eplb.dispatch.sglang import SglangStatic  # noqa: E402


def _workload():
    """(load of the decision [L, E], the served placement, the topology)."""
    tr = eplb.load_trace(ROOT / "traces" / "deepseek.npz")
    counts = np.asarray(tr.counts_TLE, dtype=np.float64)
    half = counts.shape[0] // 2
    topo = eplb.Topology(num_gpus=32, slots_per_gpu=9, num_nodes=4)
    served = eplb.plan(counts[:half].sum(axis=0), topology=topo, planner="greedy").placement
    return counts[half:].sum(axis=0), served, topo


def _decide(load, served, topo, dispatch=None):
    budget = eplb.Budget(max_moves=load.shape[0] * 8, move_cost=0.05)
    return eplb.plan(load, topology=topo, planner="greedy", previous=served, budget=budget, dispatch=dispatch)


def _time(fn, repeats):
    fn()  # warm: compiled code loaded, caches filled
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


CASES: dict = {
    # name: (serving call it sits on, module, attribute, "module:numpy version", bind SGLang's rule)
    # The share-keeping repair's step (eplb/migration/_repair_kernel.py) was a case here until it
    # measured 5144 ms with the kernel, 5115 ms with numpy (0.99x, the same plan) and went
    # (run this file at commit 9ea33ac to repeat it).
}

MOVES = ("count_moves", "keep_counts", "keep_slots")
"""The move counting kernels (`_moves_kernel`) beside tests/oracles/migration.py, per call."""


def _moves_rows(served, load, topo, repeats):
    from eplb.migration import moves
    from tests.oracles import migration as oracle

    new = _decide(load, served, topo).solution.phy2log_LP
    old, G, E = served.phy2log_LP, topo.num_gpus, load.shape[1]
    calls = {"count_moves": (lambda: moves.count_moves(old, new, G, E), lambda: oracle.count_moves(old, new, G, E)),
             "keep_counts": (lambda: moves._keep_counts(old, new, G, E), lambda: oracle.keep_counts(old, new, G, E)),
             "keep_slots": (lambda: moves.keep_slots(old, new, G), lambda: oracle.keep_slots(old, new, G))}
    rows = []
    for name in MOVES:
        k, n = calls[name]
        rows.append((f"{name} (eplb/migration/_moves_kernel.py)", "one call, [L, P] maps",
                     _time(k, repeats), _time(n, repeats), bool(np.array_equal(k(), n()))))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--write-docs", action="store_true")
    a = ap.parse_args(argv)
    import importlib

    load, served, topo = _workload()
    rows = []
    for name, (path, mod, attr, ref, rule) in CASES.items():
        m = importlib.import_module(mod)
        rm, ra = ref.split(":")
        numpy_fn = getattr(importlib.import_module(rm), ra)
        kernel_fn = getattr(m, attr)
        call = (lambda: _decide(load, served, topo, SglangStatic())) if rule else (lambda: _decide(load, served, topo))
        same = []
        out = {}
        for label, fn in (("kernel", kernel_fn), ("numpy", numpy_fn)):
            setattr(m, attr, fn)
            try:
                out[label] = _time(call, a.repeats)
                same.append(call().solution.phy2log_LP)
            finally:
                setattr(m, attr, kernel_fn)
        rows.append((name, path, out["kernel"], out["numpy"], bool(np.array_equal(*same))))
    rows += _moves_rows(served, load, topo, a.repeats)
    decision = {"greedy": _time(lambda: _decide(load, served, topo), a.repeats),
                "greedy, SGLang static": _time(lambda: _decide(load, served, topo, SglangStatic()), a.repeats)}
    lines = ["| kernel | serving call | with kernel (ms) | with numpy (ms) | numpy / kernel | same plan |",
             "|---|---|---:|---:|---:|---|"]
    for name, path, k, n, same in rows:
        lines.append(f"| {name} | {path} | {k * 1e3:.2f} | {n * 1e3:.2f} | {n / k:.2f} | {same} |")
    lines += ["", "The rebalance decision these sit on (kernels compiled), median ms:", ""]
    lines += [f"- {k}: {v * 1e3:.0f} ms" for k, v in decision.items()]
    print("\n".join(lines))
    if a.write_docs:
        (ROOT / "docs" / "results" / "kernels.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
