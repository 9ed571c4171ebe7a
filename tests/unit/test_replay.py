"""Closed-loop replay (eplb.evaluate.replay), its file (eplb.formats.replay) and `eplb replay` / `eplb plot replay`."""

import json

import numpy as np
import pytest

from eplb import EplbError
from eplb.cli import main
from eplb.core.placement import Placement
from eplb.core.topology import Topology
from eplb.core.trace import Trace, default_meta
from eplb.evaluate.replay import Scoring, cut_windows, replay
from eplb.formats import save_trace
from eplb.formats.replay import read_replay, write_replay

L, E, G, S = 3, 16, 4, 5
TOPO = Topology(G, S)


def drifting(seed=0, T=14, shift_at=9, tokens=3000):
    """Counts [T, L, E]: one traffic mix, then two cold experts turn hot at `shift_at`."""
    rng = np.random.default_rng(seed)
    p = rng.gamma(3.0, 1.0, (L, E))
    p[:, 0] *= 5.0
    q = p.copy()
    q[:, [9, 13]] *= 25.0
    out = []
    for t in range(T):
        w = (q if t >= shift_at else p) / (q if t >= shift_at else p).sum(axis=1, keepdims=True)
        out.append(np.stack([rng.multinomial(tokens, w[l]) for l in range(L)]))
    return np.stack(out)


@pytest.fixture(scope="module")
def counts():
    return drifting()


@pytest.fixture(scope="module")
def result(counts):
    return replay(counts, topology=TOPO, warmup=6)


def test_replay_scores_every_served_window_against_the_references(result, counts):
    s = result.summary()
    assert s["served_windows"] == 8 and result.window_T.tolist() == list(range(6, 14))
    assert s["rules"] == ["even", "resplit"]
    for run in ("policy", "static", "hindsight"):
        for rule in s["rules"]:
            o = s[run][rule]
            assert 1.0 <= o["median"] <= o["p95"] <= o["max"] and 0 < o["balancedness"] <= 1
    # hindsight plans on the served window itself: nothing served beats it by much
    assert s["hindsight"]["even"]["median"] <= s["policy"]["even"]["median"] + 1e-9
    # after the shift the policy follows the traffic; the static plan does not
    assert s["policy"]["even"]["p95"] < s["static"]["even"]["p95"]
    assert s["decisions"] >= 1 and s["moves"] == int(result.moves_T.sum()) > 0
    assert len(s["per_window"]) == 8 and json.dumps(s)
    np.testing.assert_array_equal(result.counts_TLE, counts[6:])


def test_static_policy_is_the_static_reference(counts, result):
    st = replay(counts, topology=TOPO, warmup=6, policy="static", references=())
    np.testing.assert_array_equal(st.scores.imbalance_RTL, result.references["static"].imbalance_RTL)
    assert st.summary()["moves"] == 0 and (st.phy2log_TLP == st.phy2log_TLP[0]).all()


def test_a_decision_takes_effect_after_the_delay(counts):
    for delay in (0, 1, 2):
        r = replay(counts, topology=TOPO, warmup=6, delay=delay, references=())
        decided = np.flatnonzero(r.decided_T)
        applied = np.flatnonzero(r.applied_T)
        assert decided.size >= 1
        np.testing.assert_array_equal(applied, (decided + 1 + delay)[:applied.size])
        for t in applied:
            assert (r.phy2log_TLP[t] != r.phy2log_TLP[t - 1]).any()


def test_replay_never_looks_ahead(counts):
    """Change every window from k on: nothing decided or served before k may change."""
    k = 10
    other = counts.copy()
    other[k:] = drifting(seed=7, T=counts.shape[0])[k:][:, :, ::-1]
    for policy, settings in (("adaptive", {}), ("window", {"window": 2}), ("adaptive", {"rule": "resplit"})):
        a = replay(counts, topology=TOPO, warmup=6, policy=policy, settings=settings)
        b = replay(other, topology=TOPO, warmup=6, policy=policy, settings=settings)
        i = k - 6                                     # served index of window k
        # the placement serving window k was decided from windows < k: the same
        np.testing.assert_array_equal(a.phy2log_TLP[:i + 1], b.phy2log_TLP[:i + 1])
        np.testing.assert_array_equal(a.decided_T[:i], b.decided_T[:i])
        np.testing.assert_array_equal(a.moves_T[:i], b.moves_T[:i])
        np.testing.assert_array_equal(a.scores.imbalance_RTL[:, :i], b.scores.imbalance_RTL[:, :i])
        for ref in ("static", "hindsight"):
            np.testing.assert_array_equal(a.references[ref].imbalance_RTL[:, :i],
                                          b.references[ref].imbalance_RTL[:, :i])
        assert not np.array_equal(a.scores.imbalance_RTL[:, i:], b.scores.imbalance_RTL[:, i:])


def test_the_file_rescores_independently(result, tmp_path):
    path = write_replay(result, tmp_path / "r.npz")
    arrays, meta = read_replay(path)
    assert meta["rules"] == ["even", "resplit"] and meta["weights_rule"] == "resplit"
    from eplb import stats

    for t in range(arrays["phy2log_TLP"].shape[0]):
        pl = Placement(arrays["phy2log_TLP"][t], G, E)
        c = arrays["counts_TLE"][t].astype(float)
        resplit = stats.imbalance(pl.gpu_loads(c, arrays["weights_TLP"][t]))
        even = stats.imbalance(pl.gpu_loads(c))
        np.testing.assert_allclose(resplit, arrays["policy_imbalance_RTL"][1, t])
        np.testing.assert_allclose(even, arrays["policy_imbalance_RTL"][0, t])


def test_a_failed_write_keeps_the_old_file(result, tmp_path, monkeypatch):
    path = tmp_path / "r.npz"
    path.write_bytes(b"old")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez_compressed", boom)
    with pytest.raises(EplbError, match="disk full .the previous r.npz is unchanged"):
        write_replay(result, path)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["r.npz"]


def test_read_replay_refuses_other_files(tmp_path):
    np.savez(tmp_path / "x.npz", a=np.zeros(3))
    with pytest.raises(EplbError, match="not an eplb replay file"):
        read_replay(tmp_path / "x.npz")
    with pytest.raises(EplbError, match="does not exist"):
        read_replay(tmp_path / "none.npz")


def test_scoring_takes_rules(counts):
    r = replay(counts, topology=TOPO, warmup=6, scoring=Scoring(("even",)), references=("static",))
    assert r.rules == ("even",) and r.scores.seconds_RTL is None and r.weights_rule == "even"
    with pytest.raises(EplbError, match="unknown dispatch rule"):
        Scoring(("nope",))
    with pytest.raises(EplbError, match="repeat"):
        Scoring(("even", "even"))
    with pytest.raises(EplbError, match="needs|give Scoring\\(time="):
        Scoring(("time",))
    with pytest.raises(EplbError, match="TimeObjective"):
        Scoring(time=lambda g: g)


def v2_shape(seed=0, T=10, tokens=2048):
    """Counts [T, 3, 64] in DeepSeek-V2-Lite's shape (64 experts, top-6): one mix, then a shift."""
    rng = np.random.default_rng(seed)
    p = rng.gamma(1.0, 1.0, (3, 64))
    q = p.copy()
    q[:, [5, 40]] *= 20.0
    return np.stack([np.stack([rng.multinomial(tokens * 6, (w / w.sum(axis=1, keepdims=True))[l]) for l in range(3)])
                     for w in [p] * 6 + [q] * (T - 6)])


def test_replay_scores_modeled_step_time_with_the_time_dispatch():
    from eplb.dispatch.cost import TimeObjective, cost_model, slot_rows, step_cost
    from eplb.evaluate.simulate import window_batches

    counts = v2_shape()
    obj = TimeObjective(cost_model("deepseek-v2-lite", "h200"), batch_tokens=64)
    topo = Topology(8, 9)
    r = replay(counts, topology=topo, warmup=5, objective=obj, scoring=Scoring(time=obj, batches_per_window=3))
    assert r.rules == ("even", "resplit", "time") and r.weights_rule == "time" and r.objective == "time"
    assert r.scores.seconds_RTL.shape == (3, 5, 3) and (r.scores.seconds_RTL > 0).all()
    s = r.summary()
    for run in ("policy", "static", "hindsight"):
        t = s[run]["time"]["step_seconds"]
        assert 0 < t["median"] <= t["p95"] and s[run]["even"]["step_seconds"]["median"] > 0
    # The time dispatch is never slower than the even split, layer by layer (in the model).
    assert (r.scores.seconds_RTL[2] <= r.scores.seconds_RTL[0] * (1 + 1e-9)).all()
    assert s["time"]["batch_tokens"] == 64 and "drawn" in s["time"]["how"]
    # Re-scored independently: window 0's even-split seconds from its batches, as replay draws them.
    batches = window_batches(counts[5].astype(float), 6, 64, 3, np.random.default_rng([0, 5]), 5)
    pl = Placement(r.phy2log_TLP[0], 8, 64)
    even = np.mean([step_cost(obj.cost, pl, slot_rows(pl, b.counts_LE), 64).layer_s_L for b in batches], axis=0)
    np.testing.assert_allclose(r.scores.seconds_RTL[0, 0], even)
    # weights_TLP holds the time dispatch's shares: per expert they sum to 1.
    w = r.weights_TLP[0]
    sums = np.zeros((3, 64))
    np.add.at(sums, (np.arange(3)[:, None], r.phy2log_TLP[0]), w)
    np.testing.assert_allclose(sums, 1.0)
    with pytest.raises(EplbError, match="experts but DeepSeek-V3"):
        replay(counts, topology=topo, warmup=5, scoring=Scoring(time=TimeObjective(cost_model("deepseek-v3", "h200"))))


def per_token_trace(tokens=1000, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.stack([np.stack([rng.choice(E, 2, replace=False) for _ in range(L)]) for _ in range(tokens)])
    window = np.repeat(np.arange(2), tokens // 2).astype(np.int32)
    counts = np.stack([np.stack([np.bincount(ids[window == w][:, l].ravel(), minlength=E) for l in range(L)])
                       for w in range(2)])
    return Trace(counts, np.arange(L), default_meta(L, E), ids, window)


def test_per_token_traces_are_cut_into_windows_of_k_tokens():
    tr = per_token_trace()
    c, how = cut_windows(tr, 300)
    assert c.shape == (3, L, E) and (c.sum(axis=2) == 600).all() and "100 left over" in how
    ids = tr.topk_ids_NLK.astype(int)
    np.testing.assert_array_equal(c[1, 2], np.bincount(ids[300:600, 2].ravel(), minlength=E))
    with pytest.raises(EplbError, match="1200 tokens per window exceed the trace's 1000 tokens"):
        cut_windows(tr, 1200)
    with pytest.raises(EplbError, match="per-token"):
        cut_windows(tr.windows(0), 10)


def test_bad_replay_input(counts):
    with pytest.raises(EplbError, match=r"14 window\(s\), not more than the warmup \(14\)"):
        replay(counts, topology=TOPO, warmup=14)
    with pytest.raises(EplbError, match="no setting 'speed'"):
        replay(counts, topology=TOPO, settings={"speed": 1})
    with pytest.raises(EplbError, match="delay"):
        replay(counts, topology=TOPO, delay=-1)
    with pytest.raises(EplbError, match="unknown reference"):
        replay(counts, topology=TOPO, references=("oracle",))
    with pytest.raises(EplbError, match="'optimal'"):
        replay(counts, topology=TOPO, plan_for="optimal")
    with pytest.raises(EplbError, match="window"):
        replay(counts, topology=TOPO, plan_for="resplit", policy="window")
    with pytest.raises(EplbError, match="rule='even'"):
        replay(counts, topology=TOPO, plan_for="resplit", settings={"rule": "even"})


def test_planning_for_resplit_serves_resplit_better(counts):
    """The warm-up plan searched for re-split, then the policy planning for it: re-split scores at
    least as good as the even plan's on the served windows, and it says what it did. The even
    policy plans on its whole memory (drift test off) as the re-split rule does: the test
    compares the rules, not the memories."""
    even = replay(counts, topology=TOPO, warmup=6, references=("static",), settings={"drift_horizons": "off"})
    rs = replay(counts, topology=TOPO, warmup=6, references=("static",), plan_for="resplit")
    assert "searched for the re-split rule" in rs.notes[1] and rs.settings == {"rule": "resplit"}
    r = list(rs.rules).index("resplit")
    assert rs.references["static"].imbalance_RTL[r].mean() <= even.references["static"].imbalance_RTL[r].mean()
    assert np.median(rs.scores.imbalance_RTL[r]) <= np.median(even.scores.imbalance_RTL[r]) + 1e-9


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory, counts):
    path = tmp_path_factory.mktemp("rp") / "t.npz"
    save_trace(Trace(counts, np.arange(L), default_meta(L, E)), path)
    return path


def test_cli_replay_and_plot(trace_file, tmp_path, capsys):
    out, fig = tmp_path / "r.npz", tmp_path / "r.png"
    assert main(["replay", str(trace_file), "--gpus", str(G), "--slots-per-gpu", str(S), "--warmup", "6",
                 "--bytes-per-expert", "1000", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "adaptive" in text and "hindsight" in text and "moves" in text and "wrote" in text
    assert main(["plot", "replay", str(out), "-o", str(fig), "--rule", "resplit"]) == 0
    assert fig.stat().st_size > 10_000
    capsys.readouterr()
    assert main(["replay", str(trace_file), "--gpus", str(G), "--slots-per-gpu", str(S), "--policy", "window",
                 "--set", "window=all", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["policy_name"] == "window" and s["settings"] == {"window": None}
    assert main(["replay", str(trace_file), "--gpus", str(G), "--slots-per-gpu", str(S), "--plan-for", "resplit"]) == 0
    assert "searched for the re-split rule" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (["--warmup", "20"], "not more than the warmup (20)"),
    (["--set", "speed=2"], "policy 'adaptive' has no setting 'speed'"),
    (["--set", "horizons=2,99"], "horizons [2, 99] must be 1 to memory (16) windows"),
    (["--tokens-per-window", "5000"], "per-token expert choices"),
    (["--rule", "nope"], "unknown dispatch rule 'nope'"),
    (["--plan-for", "resplit", "--policy", "window"], "use the adaptive or the static policy"),
])
def test_cli_bad_input_is_one_line_and_exit_2(trace_file, capsys, extra, message):
    assert main(["replay", str(trace_file), "--gpus", str(G), "--slots-per-gpu", str(S), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_cli_replay_in_modeled_time(tmp_path, capsys):
    counts = v2_shape(T=8)
    path = tmp_path / "v2.npz"
    save_trace(Trace(counts, np.arange(1, 4), default_meta(27, 64, top_k=6)), path)
    base = ["replay", str(path), "--gpus", "8", "--slots-per-gpu", "9", "--warmup", "5"]
    assert main([*base, "--objective", "time", "--model", "deepseek-v2-lite", "--hardware", "h200",
                 "--batch-tokens", "64", "--batches", "2"]) == 0
    text = capsys.readouterr().out
    assert "step ms median" in text and "planned for modeled time" in text and "drawn per window" in text
    # Time beside the token ratios: every run's row carries its ratios and its step ms.
    lines = text.splitlines()
    head = next(line for line in lines if line.startswith("run "))
    assert head.split()[:6] == ["run", "dispatch", "median", "p95", "max", "balancedness"] and "step ms p95" in head
    rows = [line.split() for line in lines if line.split()[:1] in (["adaptive"], ["static"], ["hindsight"])]
    assert [r[1] for r in rows] == ["even", "resplit", "time"] * 3
    for r in rows:
        ratios, ms = [float(x) for x in r[2:5]], [float(x) for x in r[6:8]]
        assert 1.0 <= ratios[0] <= ratios[1] <= ratios[2] and 0 < ms[0] <= ms[1]
    assert main([*base, "--model", "deepseek-v2-lite", "--hardware", "h200", "--batches", "1", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["objective"] == "tokens" and s["rules"] == ["even", "resplit", "time"]
    assert s["policy"]["time"]["step_seconds"]["median"] > 0
    for extra, message in ((["--objective", "time"], "give --model M and --hardware H"),
                           (["--hardware", "h200"], "--hardware needs --model"),
                           (["--rule", "time"], "give Scoring(time=")):
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


@pytest.mark.parametrize("model, hardware, message", [
    ("deepseek-v9", "h200", "unknown model 'deepseek-v9'"),
    ("deepseek-v2-lite", "tpu-v9", "unknown hardware 'tpu-v9'"),
])
def test_cli_bad_time_names_are_exit_2_naming_the_value(trace_file, capsys, model, hardware, message):
    assert main(["replay", str(trace_file), "--gpus", str(G), "--slots-per-gpu", str(S), "--objective", "time",
                 "--model", model, "--hardware", hardware]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
