"""Planning from a served placement under SGLang's rules (eplb.migration.rule, planners.rule_previous).

The rules' shares follow the layout, so the migration step judges its candidates by binding
the rule; these tests check that the fitted plan keeps the balance a plan from scratch gets,
that a budget never serves worse than keeping the placement, that the share-keeping swaps
keep every share exactly, and that the Rebalancer and the SGLang plug-in take this path.
"""

import numpy as np
import pytest

from eplb.core.placement import Placement
from eplb.dispatch.sglang import SglangDynamic, SglangStatic
from eplb.errors import EplbError
from eplb.migration import Budget, count_moves, layout_dependent
from eplb.migration.rule import repair_swaps
from eplb.planning.front_door import plan
from eplb.serving.rebalance import Rebalancer
from planners.rule_previous import fit_gpus, held_by_gpu, match_units
from tests.placements import spread_placement

RULES = [SglangStatic(), SglangStatic(path="rebalance"), SglangDynamic()]
TOPO = dict(num_gpus=8, num_nodes=4, num_redundant=8)


def _loads(rng, L=4, E=32):
    """Skewed loads whose hottest expert needs no more replicas than there are nodes."""
    return np.floor(rng.lognormal(0.0, 0.8, (L, E)) * 100) + 1


def _served(placement, load, rule):
    """Busiest GPU per layer when `rule` serves `load` on `placement`, [L]."""
    return placement.gpu_loads(load, rule.bind(placement)(load)).max(axis=1)


def _random_placement(rng, L=4, E=32, G=8, N=4, S=5):
    return spread_placement(rng, L, E, G, N, S)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.name}-{r.path}")
def test_plan_from_previous_keeps_the_balance_served(rng, rule):
    old_load, load = _loads(rng), _loads(rng)
    previous = plan(old_load, dispatch=rule, **TOPO).placement
    scratch = plan(load, dispatch=rule, **TOPO)
    r = plan(load, dispatch=rule, previous=previous, **TOPO)
    mig = r.info["migration"]
    assert mig["method"] in ("planned", "relabel") and mig["dispatch"] == rule.name
    # The planner fitted its plan itself; a relabelling wins only if the rule serves it as well, for fewer moves.
    assert r.info["served_matches_plan"] and mig["moves"] <= r.info["fitted_to_previous"]["moves"]
    # Scored under the rule, exactly as binding it gives.
    assert np.allclose(_served(r.placement, load, rule), r.served.imbalance_L * load.sum(axis=1) / 8)
    # The served balance of a plan from scratch (what relabelling used to lose), for fewer moves.
    assert r.served.imbalance_L.max() <= scratch.served.imbalance_L.max() + 0.01
    assert np.median(r.served.imbalance_L) <= np.median(scratch.served.imbalance_L) + 0.01
    assert mig["moves"] < count_moves(previous.phy2log_LP, scratch.placement.phy2log_LP, 8, 32).sum()


@pytest.mark.parametrize("budget", [Budget(max_moves=6), Budget(max_moves_per_gpu=1), Budget(move_cost=0.01)])
def test_budget_never_serves_worse_than_keeping_the_placement(rng, budget):
    rule = SglangStatic()
    load = _loads(rng)
    previous = _random_placement(rng)
    r = plan(load, dispatch=rule, previous=previous, budget=budget, **{**TOPO, "num_redundant": 8})
    mig = r.info["migration"]
    kept = _served(previous, load, rule)
    got = _served(r.placement, load, rule)
    assert (got <= kept * (1 + 1e-12)).all()  # no layer served worse than keeping the placement
    assert got.sum() < kept.sum()  # the random placement leaves room: the budget buys something
    assert mig["moves"] == count_moves(previous.phy2log_LP, r.placement.phy2log_LP, 8, 32).sum()
    if budget.max_moves is not None:
        assert mig["moves"] <= budget.max_moves
    if budget.max_moves_per_gpu is not None:
        assert mig["moves_max_per_gpu"] <= budget.max_moves_per_gpu
    # Candidates that serve some layer worse even with those layers put back are left out.
    assert {"previous", "repair"} <= set(mig["candidates"]) <= {
        "planned", "relabel", "previous", "budgeted_search", "repair", "budgeted_search+repair"}
    assert mig["method"] in mig["candidates"] and mig["candidates"][mig["method"]]["fits"]
    if mig["method"] not in ("planned", "relabel"):
        assert r.status == "HEURISTIC" and f"judged under {rule.name}" in r.message


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.name}-{r.path}")
def test_repair_swaps_keep_every_share(rng, rule):
    load = _loads(rng)
    start = _random_placement(rng, N=2)
    w_LP = rule.bind(start)(load)
    fixed_LP, fixed_w_LP = repair_swaps(load, start.phy2log_LP, w_LP, start.phy2log_LP, start.topology,
                                        Budget(max_moves=10))
    fixed = Placement(fixed_LP, 8, 32, 2)
    assert np.allclose(rule.bind(fixed)(load), fixed_w_LP)  # the shares moved with their replicas, unchanged
    before = start.gpu_loads(load, w_LP).max(axis=1)
    after = fixed.gpu_loads(load, fixed_w_LP).max(axis=1)
    assert (after <= before + 1e-9).all() and after.sum() < before.sum()
    assert count_moves(start.phy2log_LP, fixed_LP, 8, 32).sum() <= 10


def test_fitting_helpers_rename_without_changing_units(rng):
    previous = _random_placement(rng)
    held = held_by_gpu(previous.phy2log_LP, 8, 32)
    # Renaming GPUs inside a node keeps which node holds which expert; a renamed copy is undone.
    swapped = previous.phy2log_LP.reshape(4, 8, 5)[:, [1, 0, 3, 2, 5, 4, 7, 6]].reshape(4, 40)
    assert np.array_equal(fit_gpus(swapped, held, 4), previous.phy2log_LP)
    units = np.zeros((4, 32, 4), dtype=np.int64)
    units[:, :8, 0] = units[:, 8:16, 1] = 1
    renamed = match_units(units, held)
    assert (renamed.sum(axis=2) == units.sum(axis=2)).all()  # each expert keeps its number of units


def test_rebalancer_plans_and_scores_under_the_rule(rng):
    rule = SglangStatic(path="rebalance")
    assert layout_dependent(rule) and not layout_dependent(plan(_loads(rng), **TOPO).dispatch)
    previous = plan(_loads(rng), dispatch=rule, **TOPO).placement
    rb = Rebalancer(previous, interval=1, min_improvement=0.0, dispatch=rule, budget=Budget())
    assert rb.planner == "rule-aware"
    load = _loads(rng)
    assert rb.observe(load)
    res = rb.rebalance()
    assert res.info["method"] in ("planned", "relabel")
    assert np.allclose(res.after.gpu_load_LG.max(axis=1), _served(res.placement, load, rule))
    assert np.allclose(res.before.gpu_load_LG.max(axis=1), _served(previous, load, rule))
    scratch = plan(load, dispatch=rule, **TOPO).served
    assert np.median(res.after.imbalance_L) <= np.median(scratch.imbalance_L) + 0.01
    # With the default budget (a price per move) the served sum is never above keeping it.
    rb2 = Rebalancer(res.placement, interval=1, min_improvement=0.0, dispatch=rule)
    rb2.observe(_loads(rng))
    res2 = rb2.rebalance()
    assert (res2.after.gpu_load_LG.max(axis=1) <= res2.before.gpu_load_LG.max(axis=1) * (1 + 1e-12)).all()
    with pytest.raises(EplbError, match="decides for an even split"):
        Rebalancer(previous, dispatch=rule, policy="adaptive")


def test_sglang_plugin_rebalance_keeps_replicas_under_the_rule(rng, monkeypatch):
    torch = pytest.importorskip("torch")
    from eplb.integrations import sglang as plugin

    H, E, G, N, S = 6, 32, 8, 4, 5
    moe = np.array([1, 2, 4, 5])
    counts_A = np.zeros((2, H, E))
    counts_A[:, moe] = np.stack([_loads(rng), _loads(rng)])
    counts_B = np.zeros((2, H, E))
    counts_B[:, moe] = np.stack([_loads(rng), _loads(rng)])
    monkeypatch.setenv(plugin.ENV_PLANNER, "rule-aware")
    monkeypatch.setenv(plugin.ENV_DISPATCH, "static")
    monkeypatch.setattr(plugin, "_current_map", lambda: None)
    first = plugin.rebalance_experts(torch.from_numpy(counts_A), G * S, S, 8, N)[0].numpy()
    scratch = plugin.rebalance_experts(torch.from_numpy(counts_B), G * S, S, 8, N)[0].numpy()
    monkeypatch.setattr(plugin, "_current_map", lambda: first)  # SGLang's periodic rebalance serves `first`
    again = plugin.rebalance_experts(torch.from_numpy(counts_B), G * S, S, 8, N)[0].numpy()
    rule = SglangStatic(path="rebalance", num_hidden_layers=H)
    load = counts_B[:, moe].sum(axis=0)
    p_again, p_scratch = (Placement(m[moe], G, E, N, moe) for m in (again, scratch))
    assert count_moves(first[moe], again[moe], G, E).sum() < count_moves(first[moe], scratch[moe], G, E).sum()
    served_again, served_scratch = _served(p_again, load, rule), _served(p_scratch, load, rule)
    assert served_again.max() <= served_scratch.max() * 1.01
    monkeypatch.setenv(plugin.ENV_PLANNER, "rule-aware,max_moves=4")
    budgeted = plugin.rebalance_experts(torch.from_numpy(counts_B), G * S, S, 8, N)[0].numpy()
    assert count_moves(first[moe], budgeted[moe], G, E).sum() <= 4
    p_first, p_budgeted = (Placement(m[moe], G, E, N, moe) for m in (first, budgeted))
    assert (_served(p_budgeted, load, rule) <= _served(p_first, load, rule) * (1 + 1e-12)).all()
