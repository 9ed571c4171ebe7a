"""Planning for an engine that re-splits every batch: `eplb plan --dispatch resplit` and
`--engine sglang --dispatch lp` (eplb.planning.resplit_plan), SGLang's lp rule as eplb models it
(eplb.dispatch.sglang_lp), and their refusals. The lp model against SGLang's own solver is in
tests/engines/test_sglang_lp.py."""

import json

import numpy as np
import pytest

from eplb.cli import main
from eplb.core.placement import Placement
from eplb.core.trace import Trace, default_meta
from eplb.dispatch.cost import TimeObjective, cost_model
from eplb.dispatch.resplit_score import resplit_imbalance
from eplb.dispatch.rules import optimal_weights
from eplb.dispatch.sglang_lp import SglangLp, affine_scaling, lp_fits
from eplb.errors import EplbError
from eplb.formats import load_placement, save_trace
from eplb.migration import Budget, count_moves
from eplb.planning.front_door import plan, plan_for_resplit

T, L, E, G = 6, 4, 32, 8


def _windows(seed=0):
    rng = np.random.default_rng(seed)
    p = rng.gamma(0.4, 1.0, (L, E))  # skewed: an even split leaves GPUs above the mean
    return np.stack([np.stack([rng.multinomial(4000, p[l] / p[l].sum()) for l in range(L)]) for _ in range(T)])


@pytest.fixture
def skewed(tmp_path):
    path = tmp_path / "skewed.npz"
    save_trace(Trace(_windows(), np.arange(L), default_meta(L, E)), path)
    return str(path)


def _cost(imb_ML):
    return 0.5 * imb_ML.mean(axis=0) + 0.5 * imb_ML.max(axis=0)


def test_cli_plans_for_resplit_without_engine(skewed, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", skewed, "--gpus", str(G), "--nodes", "2", "--dispatch", "resplit", "-o", str(out),
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["dispatch"] == "resplit" and summary["info"]["resplit"]["windows"] == T
    rs = summary["resplit"]
    assert rs["plan"]["median"] <= rs["even-split plan"]["median"] and rs["plan"]["max"] <= rs["even-split plan"]["max"]
    # The written plan, scored here from scratch: no layer worse than the even-split plan's.
    win = _windows().astype(float)
    written = load_placement(out).phy2log_LP
    even = plan(win, num_gpus=G, num_nodes=2, planner="robust").solution.phy2log_LP
    mine, theirs = resplit_imbalance(written, win, G), resplit_imbalance(even, win, G)
    assert (_cost(mine) <= _cost(theirs) + 1e-12).all() and _cost(mine).sum() < _cost(theirs).sum()
    assert np.isclose(np.median(mine), rs["plan"]["median"])


def test_cli_plans_for_sglang_lp(skewed, tmp_path, capsys):
    out = tmp_path / "map.json"
    assert main(["plan", skewed, "--gpus", str(G), "--nodes", "2", "--engine", "sglang", "--dispatch", "lp",
                 "-o", str(out)]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "lists cut to its nearest replica" in captured.err  # the start-up file skips the LP on most ranks
    assert "served by sglang (sglang-lp)" in text and "plan, served by sglang-lp (startup)" in text
    assert "physical_to_logical_map" in json.loads(out.read_text())


def test_plan_with_previous_keeps_the_budget():
    win = _windows(1).astype(float)
    old = plan(win[:2], num_gpus=G, planner="greedy").placement
    for cap in (0, 3):
        r = plan(win, num_gpus=G, planner="robust", previous=old, budget=Budget(max_moves=cap), dispatch="resplit")
        assert r.info["resplit"]["start"] == "previous"
        moves = count_moves(old.phy2log_LP, r.solution.phy2log_LP, G, E).sum()
        assert moves <= cap and r.info["migration"]["moves"] == moves
    # Keeping is a candidate: the result never serves the windows worse than the served map.
    assert (_cost(resplit_imbalance(r.solution.phy2log_LP, win, G))
            <= _cost(resplit_imbalance(old.phy2log_LP, win, G)) + 1e-12).all()


def test_lp_rule_is_near_the_optimum_and_feasible():
    win = _windows(2).astype(float)
    pl = plan(win, num_gpus=G, num_nodes=2, planner="greedy").placement
    opt_L = pl.gpu_loads(win[0], optimal_weights(pl, win[0])).max(axis=1)
    for path in ("rebalance", "startup"):
        w_LP = SglangLp(path=path).bind(pl)(win[0])
        sums = np.zeros((L, E))
        np.add.at(sums, (np.arange(L)[:, None].repeat(pl.num_slots, 1), pl.phy2log_LP), w_LP)
        assert np.allclose(sums, 1.0)  # shares of each expert sum to 1
        busy_L = pl.gpu_loads(win[0], w_LP).max(axis=1)
        assert (busy_L >= opt_L * (1 - 1e-6)).all()
    # After a rebalance every rank follows the LP: within a few percent of the optimum.
    busy_L = pl.gpu_loads(win[0], SglangLp(path="rebalance").bind(pl)(win[0])).max(axis=1)
    assert (busy_L <= opt_L * 1.05).all()


def test_affine_scaling_solves_a_small_lp_and_falls_back_when_short():
    # min t s.t. x1 + x2 = 1, x1 + s1 - t = 0, x2 + s2 - t = 0 (+ the artificial column): t = 0.5.
    A = np.array([[1, 1, 0, 0, 0], [1, 0, 1, 0, -1], [0, 1, 0, 1, -1]], dtype=np.float32)
    b = np.array([1, 0, 0], dtype=np.float32)
    A = np.concatenate([A, (b - A.sum(axis=1))[:, None]], axis=1)[None]
    c = np.array([0, 0, 0, 0, 1, 1000], dtype=np.float32)
    x, kept = affine_scaling(A, b[None], c, steps=5)
    assert kept[0] and abs(x[0, 4] - 0.5) < 1e-3 and abs(x[0, 0] - 0.5) < 1e-3
    x, kept = affine_scaling(A, b[None], c, steps=1)
    assert not kept[0] and (x == 0.5).all()  # SGLang's answer when its test fails: every share even


def test_lp_refusals(skewed, capsys, monkeypatch):
    big = Placement(np.arange(320)[None] % 160, 160, 160)
    assert not lp_fits(big.phy2log_LP, 160).any()
    with pytest.raises(Exception, match="SGLang's lp solver needs .* KiB"):
        SglangLp().bind(big)
    with pytest.raises(Exception, match="steps must be"):
        SglangLp(steps=0)
    monkeypatch.setenv("EPLB_MAX_INPUT_BYTES", "40KiB")
    assert main(["plan", skewed, "--gpus", str(G), "--dispatch", "resplit"]) == 2
    err = capsys.readouterr().err
    assert "the re-split score of 6 windows x 4 layers on 8 GPUs" in err and "EPLB_MAX_INPUT_BYTES" in err
    assert err.count("\n") == 1


def test_front_door_searches_for_a_resplit_rule():
    # eplb.plan(dispatch="resplit") runs the search the CLI runs, on the planning windows.
    win = _windows(3).astype(float)
    even = plan(win, num_gpus=G, planner="greedy", dispatch="resplit", resplit_rounds=0)
    assert "resplit" not in even.info
    searched = plan(win, num_gpus=G, planner="greedy", dispatch="resplit")
    assert searched.info["resplit"]["windows"] == T and searched.dispatch.name == "resplit"
    again = plan_for_resplit(even, win)
    np.testing.assert_array_equal(searched.solution.phy2log_LP, again.solution.phy2log_LP)
    mine = _cost(resplit_imbalance(searched.solution.phy2log_LP, win, G))
    assert (mine <= _cost(resplit_imbalance(even.solution.phy2log_LP, win, G)) + 1e-12).all()
    # aggregate="last": searched (and scored) on the newest window only.
    assert plan(win, num_gpus=G, planner="greedy", dispatch="resplit", aggregate="last").info["resplit"]["windows"] == 1
    with pytest.raises(EplbError, match="plan for tokens"):
        plan(win, num_gpus=G, dispatch="resplit",
             objective=TimeObjective(cost_model("deepseek-v2-lite", "h100")))
    with pytest.raises(EplbError, match="does not re-split"):
        plan_for_resplit(plan(win, num_gpus=G, planner="greedy"), win)
    with pytest.raises(EplbError, match="resplit_rounds must be"):
        plan(win, num_gpus=G, dispatch="resplit", resplit_rounds=-1)
