"""The rule-aware planner's compiled kernels against their numpy and Python twins, to the bit.

Legend: T = windows, L = MoE layers, E = logical experts, G = GPUs, N = nodes, S = slots per GPU, P = G x S.

- `planners._rule_pack_kernel`: Step 4's packing, against `rule_aware._pack_numpy` on seeded
  cases with ties (integer loads) and window counts on both sides of numpy's pairwise blocks;
- `eplb.dispatch._sglang_draws_kernel`: SGLang's seeded draws, against Python's `random.Random`;
- `eplb.migration._repair_kernel`: the repair's search step, against its numpy twin (tests/oracles/repair.py);
- the Rebalancer warms them (`kernel_modules("rule-aware")`), and a real call compiles nothing else.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from eplb.core.placement import Placement
from eplb.dispatch import sglang as sd
from eplb.dispatch.sglang import SglangStatic, static_dispatch_maps
from eplb.planning.front_door import plan
from eplb.stats.loads import replica_counts_minmax
from planners import rule_aware as ra
from planners.robust import normalise_windows, robust_demand
from planners.rule_previous import held_by_gpu


def _pack_case(rng, T, G, N, S, E, ties):
    """Step 4's inputs for one seeded case: (share_TLE, count_LE, units_LEU, table_LEU)."""
    L = 3
    h = rng.integers(0, 4, (T, L, E)).astype(float) if ties else rng.gamma(0.5, 100.0, (T, L, E))
    h[:, h.sum(axis=(0, 2)) == 0] = 1.0
    share = normalise_windows(h, G)
    U, P = (N if N > 1 else G), G * S
    demand = robust_demand(share, 0.0)
    count = replica_counts_minmax(demand, P, max_replicas=U)
    units = ra._assign_units(demand, count, U, P // U)
    provisional = ra._provisional(count, units, G, S)
    shares = SglangStatic(path="rebalance").bind(Placement(provisional, G, E, N))(None)
    return share, count, units, ra._share_table(provisional, shares, U, E), provisional


@pytest.mark.parametrize("T", [1, 3, 8, 9, 17, 130, 300])
@pytest.mark.parametrize("G, N, S, E, ties", [(8, 2, 3, 16, True), (8, 1, 2, 12, True), (16, 4, 3, 24, False),
                                              (12, 3, 4, 32, True)])
def test_compiled_pack_is_the_numpy_pack(T, G, N, S, E, ties):
    rng = np.random.default_rng(T * 100 + G + S)
    share, count, units, table, provisional = _pack_case(rng, T, G, N, S, E, ties)
    for args in [(), (held_by_gpu(np.stack([rng.permutation(row) for row in provisional]), G, E),
                      rng.uniform(0.9, 1.3, 3) * share.sum(axis=2).max() / G)]:
        want = ra._pack(share, count, units, table, G, S, *args, compiled=False)
        got = ra._pack(share, count, units, table, G, S, *args, compiled=True)
        for a, b in zip(want, got):
            np.testing.assert_array_equal(a, b)


def test_compiled_draws_are_pythons():
    from eplb.dispatch import _sglang_draws_kernel as k

    k.warm_up()
    assert k.ready
    rng = np.random.default_rng(7)
    count_J = rng.integers(1, 30, 300)
    k_J = rng.integers(1, 64, 300)
    slots_JX = np.full((300, 30), -1, dtype=np.int64)
    for j, n in enumerate(count_J):
        slots_JX[j, :n] = rng.choice(500, n, replace=False)
    want: list[int] = []
    py = random.Random(42)
    for j, n in enumerate(count_J):
        want += sd._fair_choices(slots_JX[j, :n].tolist(), int(k_J[j]), py)
    assert k.draw(42, slots_JX, count_J, k_J).tolist() == want


@pytest.mark.parametrize("path", ["startup", "rebalance"])
def test_maps_with_compiled_draws_are_the_python_maps(path, monkeypatch):
    rng = np.random.default_rng(11)
    G, N, E = 16, 4, 64
    load = rng.gamma(0.4, 100.0, (5, E))
    p = plan(load, num_gpus=G, num_nodes=N, num_redundant=16, planner="greedy").placement
    assert sd._draws_kernel() is not None
    compiled = static_dispatch_maps(p, path=path)
    monkeypatch.setattr(sd, "_draws_kernel", lambda: None)
    np.testing.assert_array_equal(static_dispatch_maps(p, path=path), compiled)


def test_rebalancer_warms_the_rule_aware_kernels_and_a_plan_compiles_no_other_version():
    from eplb.dispatch import _sglang_draws_kernel
    from eplb.migration import Budget, _repair_kernel
    from eplb.migration.kernels import warm_up as warm_up_migration
    from eplb.serving.rebalance import kernel_modules
    from planners import _robust_kernel, _rule_pack_kernel

    modules = kernel_modules("rule-aware")
    assert modules[0] == "planners.rule_aware" and "eplb.migration.kernels" in modules
    ra.warm_up()
    warm_up_migration()
    kernels = [_rule_pack_kernel.pack_layers, _sglang_draws_kernel.fair_draws, _robust_kernel.smooth_max_swaps,
               _repair_kernel.best_swap]
    before = [len(k.signatures) for k in kernels]
    rng = np.random.default_rng(5)
    G, N, E = 8, 2, 32
    load = rng.gamma(0.5, 100.0, (2, 4, E))
    rule = SglangStatic(path="rebalance")
    first = plan(load[0], num_gpus=G, num_nodes=N, num_redundant=8, dispatch=rule).placement
    plan(load, num_gpus=G, num_nodes=N, num_redundant=8, dispatch=rule, previous=first)
    plan(load, num_gpus=G, num_nodes=N, num_redundant=8, dispatch=rule, previous=first, budget=Budget(move_cost=0.001))
    plan(load[1].astype(np.float32), num_gpus=G, num_nodes=N, num_redundant=8, dispatch=SglangStatic())
    assert [len(k.signatures) for k in kernels] == before
    assert ra.rule_pack_kernel() is not None and sd._draws_kernel() is not None  # the plans ran compiled


@pytest.mark.parametrize("seed", range(6))
def test_compiled_repair_step_is_the_numpy_step(seed):
    from eplb.migration.rule import _best_swap, _movable
    from tests.oracles.repair import _best_swap as numpy_best_swap

    rng = np.random.default_rng(seed)
    G, N, S, E = 8, 2 if seed % 2 else 1, 3, 16
    P = G * S
    for _ in range(20):
        phy_P = np.r_[rng.permutation(E), rng.integers(0, E, P - E)][rng.permutation(P)]
        x_P = rng.integers(0, 5, P).astype(float) if seed < 3 else rng.gamma(0.5, 10.0, P)  # ties, then none
        move_P = _movable(phy_P[None], G, N)[0]
        old_GE = rng.random((G, E)) < 0.3
        gpu_P = np.arange(P) // S
        args = (phy_P, x_P, move_P, old_GE, gpu_P, gpu_P // (G // N), G)
        assert _best_swap(*args) == numpy_best_swap(*args)
