"""Backtests: past-only planning, scored windows, policies, leave-one-out and the CLI."""

import json

import numpy as np
import pytest

from eplb.cli import main
from eplb.core.trace import Trace, default_meta
from eplb.errors import EplbError
from eplb.evaluate.backtest import DISPATCH, backtest, leave_one_out
from eplb.formats import save_trace


def _counts(rng, T=6, L=2, E=16):
    return rng.poisson(rng.gamma(0.7, 40.0, size=(T, L, E))).astype(np.int64)


def test_sequential_plans_on_the_past_only(rng):
    c = _counts(rng, T=7)
    r = backtest(c, num_gpus=4, planner="greedy", interval=2, history=3, quiet=True)
    assert r.mode == "sequential" and r.dispatch == DISPATCH
    assert [p.history for p in r.plans] == [(0, 3), (2, 5)]
    assert [w.window for w in r.windows] == [3, 4, 5, 6]
    for w in r.windows:
        start, stop = r.plans[w.plan_index].history
        assert stop <= w.window, "a plan saw the window it is scored on"


def test_moves_count_copies_after_relabelling(rng):
    from eplb.migration import count_moves, holdings
    from eplb.planning.front_door import plan

    c = _counts(rng, T=7)
    r = backtest(c, num_gpus=4, planner="greedy", interval=2, history=3, dispatch=("even",), oracle=False, quiet=True)
    first, second = r.plans
    assert first.moves is None  # replaces whatever was served before: not charged
    # Renaming GPUs never costs copies: the count is at most the one without renaming, and
    # at least the growth in GPUs holding each expert (each extra holder needs a copy).
    old = plan(c[0:3], num_gpus=4, planner="greedy").placement
    new = plan(c[2:5], num_gpus=4, planner="greedy").placement
    raw = int(count_moves(old.phy2log_LP, new.phy2log_LP, 4, 16).sum())
    holders = [(holdings(p.phy2log_LP, 4, 16) > 0).sum(axis=1) for p in (old, new)]  # [L, E]
    grown = int(np.maximum(holders[1] - holders[0], 0).sum())
    assert isinstance(second.moves, int) and grown <= second.moves <= raw
    s = r.summary()
    assert [(p["rebalance_window"], p["moves"]) for p in s["per_plan"]] == [(3, None), (5, second.moves)]
    assert s["moves_median"] == second.moves


def test_policies_are_ordered_and_bounded(rng):
    r = backtest(_counts(rng, T=5), num_gpus=4, planner="greedy", quiet=True)
    d = {name: i for i, name in enumerate(r.dispatch)}
    for w in r.windows:
        assert np.all(w.bound_ratio_D >= 1 - 1e-9)
        assert np.all(w.imbalance_D >= 1 - 1e-9)
        # The exact LP split is never worse than any other split of the same placement.
        assert w.imbalance_D[d["optimal"]] <= w.imbalance_D[d["even"]] + 1e-9
        assert w.imbalance_D[d["optimal"]] <= w.imbalance_D[d["resplit"]] + 1e-6
    for p in r.plans:
        assert np.all(p.optimisation_gap_D >= -1e-9)


def test_stationary_traffic_has_no_forecast_gap(rng):
    # The same window again and again: the past is the future, so the plan is the oracle's.
    one = _counts(rng, T=1)
    r = backtest(np.repeat(one, 4, axis=0), num_gpus=4, planner="greedy", history=1,
                 dispatch=("even", "optimal"), quiet=True)
    gaps = r.column("forecast_gap")
    assert np.allclose(gaps, 0.0, atol=1e-9)
    # Same history, same plan: re-planning costs no copies once GPUs are matched up.
    assert [p.moves for p in r.plans] == [None, 0, 0]


def test_no_oracle_leaves_forecast_gap_unknown(rng):
    r = backtest(_counts(rng, T=3), num_gpus=4, dispatch=("even",), oracle=False, quiet=True)
    assert np.all(np.isnan(r.column("forecast_gap")))
    assert r.summary()["median"]["forecast_gap"]["even"] is None
    # Strict JSON (no NaN tokens) so other tools can read `eplb backtest --json`.
    json.dumps(r.summary(), allow_nan=False)


def test_leave_one_out_scores_each_workload(rng):
    loads = [_counts(rng, T=1), _counts(rng, T=2), _counts(rng, T=1)]
    r = leave_one_out(loads, num_gpus=4, planner="robust", labels=["a", "b", "c"], dispatch=("even", "resplit"),
                      quiet=True)
    assert r.mode == "leave-one-out" and len(r.plans) == 3
    assert all(p.moves is None for p in r.plans)  # folds are alternatives, not a sequence
    assert r.labels == ("a", "b[0]", "b[1]", "c")
    assert [w.window for w in r.windows] == [0, 1, 1, 2]
    s = r.summary()
    assert set(s["median"]["imbalance"]) == {"even", "resplit"}
    json.dumps(s)  # JSON-ready


@pytest.mark.parametrize("kwargs, match", [
    (dict(history=6), "more windows than its history"),
    (dict(interval=0), "interval"),
    (dict(interval=2.5), r"interval must be a whole number of windows >= 1, got 2\.5"),
    (dict(interval="2"), "interval must be a whole number"),
    (dict(history=1.5), r"history must be a whole number of windows >= 1 .* got 1\.5"),
    (dict(history=0), "history must be"),
    (dict(dispatch=("fast",)), "dispatch"),
    (dict(planner="nope"), "unknown planner"),
])
def test_bad_input_is_a_user_error(rng, kwargs, match):
    with pytest.raises(EplbError, match=match):
        backtest(_counts(rng, T=6), num_gpus=4, quiet=True, **kwargs)


def test_one_window_without_history_says_all_past_not_none(rng):
    with pytest.raises(EplbError, match=r"1 window\(s\), history all past \(at least 1\)"):
        backtest(_counts(rng, T=1), num_gpus=4, quiet=True)


def test_leave_one_out_needs_two_matching_workloads(rng):
    with pytest.raises(EplbError, match="at least 2"):
        leave_one_out([_counts(rng)], num_gpus=4, quiet=True)
    with pytest.raises(EplbError, match="disagree"):
        leave_one_out([_counts(rng, E=16), _counts(rng, E=8)], num_gpus=4, quiet=True)


def _write(tmp_path, name, counts):
    path = tmp_path / name
    L, E = counts.shape[1:]
    save_trace(Trace(counts, np.arange(3, 3 + L), default_meta(3 + L, E)), path)
    return str(path)


def test_cli_table_json_and_leave_one_out(rng, tmp_path, capsys):
    a = _write(tmp_path, "a.npz", _counts(rng, T=4))
    b = _write(tmp_path, "b.npz", _counts(rng, T=1))
    assert main(["backtest", a, "--gpus", "4", "-p", "greedy", "-p", "robust", "--interval", "2",
                 "--dispatch", "even", "--dispatch", "resplit"]) == 0
    out = capsys.readouterr().out
    assert "forecast gap" in out and "robust" in out
    assert main(["backtest", a, b, "--gpus", "4", "--leave-one-out", "--no-oracle", "--json",
                 "--dispatch", "even"]) == 0
    data = json.loads(capsys.readouterr().out)
    (res,) = data["results"]
    assert res["mode"] == "leave-one-out" and res["plans"] == 2 and res["scored_windows"] == 5
    assert main(["backtest", b, "--gpus", "4"]) == 2
    assert "more windows than its history" in capsys.readouterr().err


def test_idle_window_scores_as_balanced(rng):
    """A window with no tokens is perfectly balanced under every score (sum max/mean was 0)."""
    c = _counts(rng, T=4)
    c[2] = 0
    r = backtest(c, num_gpus=4, planner="greedy", quiet=True, dispatch=("even", "resplit"))
    idle = next(w for w in r.windows if w.window == 2)
    np.testing.assert_array_equal(idle.imbalance_D, 1.0)
    np.testing.assert_array_equal(idle.imbalance_sum_D, 1.0)
    np.testing.assert_array_equal(idle.bound_ratio_D, 1.0)
    assert (r.column("imbalance_sum") >= 1.0).all()


@pytest.mark.parametrize("argv, match", [
    # --aggregate window had no --window to go with it: always "needs window >= 1, got None".
    (["--aggregate", "window"], "--history"),
    # --interval and --history apply to sequential backtests; leave-one-out ignored them.
    (["--leave-one-out", "--interval", "2"], "--interval"),
    (["--leave-one-out", "--history", "2"], "--history"),
])
def test_cli_refuses_options_that_cannot_apply(rng, tmp_path, capsys, argv, match):
    a = _write(tmp_path, "a.npz", _counts(rng, T=4))
    b = _write(tmp_path, "b.npz", _counts(rng, T=2))
    assert main(["backtest", a, b, "--gpus", "4", "--no-oracle", "-q"] + argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("eplb backtest: error: ") and match in err


def test_backtest_reports_modeled_time_with_a_time_objective():
    from eplb.dispatch.cost import TimeObjective, cost_model

    rng = np.random.default_rng(4)
    p = rng.gamma(1.0, 1.0, (3, 64))
    counts = np.stack([np.stack([rng.multinomial(6 * 2048, (p / p.sum(axis=1, keepdims=True))[l]) for l in range(3)])
                       for _ in range(5)])
    obj = TimeObjective(cost_model("deepseek-v2-lite", "h200"), batch_tokens=64)
    r = backtest(counts, num_gpus=8, num_redundant=8, history=2, objective=obj, batches_per_window=2, oracle=False)
    assert r.dispatch == ("even", "plan", "resplit", "optimal", "time") and r.timed
    sec = r.column("step_seconds")
    assert sec.shape == (3, 5) and np.isnan(sec[:, 3]).all() and (sec[:, [0, 1, 2, 4]] > 0).all()
    s = r.summary()
    assert s["time"]["batch_tokens"] == 64 and s["median"]["step_seconds"]["optimal"] is None
    assert any("optimal: not scored in modeled time" in n for n in s["notes"])
    plain = backtest(counts, num_gpus=8, num_redundant=8, history=2, oracle=False)
    assert not plain.timed and "step_seconds" not in plain.summary()["median"]
    with pytest.raises(EplbError, match="dispatch 'time'"):
        backtest(counts, num_gpus=8, num_redundant=8, history=2, dispatch=("time",))


def test_cli_backtest_in_modeled_time(tmp_path, capsys):
    from eplb.cli import main
    from eplb.core.trace import Trace, default_meta
    from eplb.formats import save_trace

    rng = np.random.default_rng(5)
    counts = rng.poisson(50.0, (4, 2, 64))
    path = tmp_path / "t.npz"
    save_trace(Trace(counts, np.arange(1, 3), default_meta(27, 64)), path)
    base = ["backtest", str(path), "--gpus", "8", "--history", "2", "--no-oracle"]
    assert main([*base, "--objective", "time", "--model", "deepseek-v2-lite", "--hardware", "h200",
                 "--batch-tokens", "32", "--batches", "1"]) == 0
    out = capsys.readouterr().out
    assert "step ms" in out and "planned for modeled time" in out
    assert main([*base, "--model", "deepseek-v2-lite", "--hardware", "h200"]) == 2
    assert "add --objective time" in capsys.readouterr().err


def test_leave_one_out_reports_modeled_time_with_a_time_objective():
    from eplb.dispatch.cost import TimeObjective, cost_model

    rng = np.random.default_rng(6)
    loads = [rng.poisson(80.0, (1, 2, 64)) for _ in range(3)]
    obj = TimeObjective(cost_model("deepseek-v2-lite", "h200"), batch_tokens=32)
    r = leave_one_out(loads, num_gpus=8, num_redundant=8, objective=obj, batches_per_window=1,
                      dispatch=("even", "time"), quiet=True)
    assert r.timed and r.dispatch == ("even", "time")
    sec = r.column("step_seconds")
    assert sec.shape == (3, 2) and (sec > 0).all()
    # The time dispatch is no slower than the even split on the same batches (in the model).
    assert (sec[:, 1] <= sec[:, 0] * (1 + 1e-9)).all()
