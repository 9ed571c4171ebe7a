"""Synthetic generator: the shipped trace's skew matches the calibration ranges; determinism; routing."""

import json
from pathlib import Path

import numpy as np
import pytest

from eplb.cli import main
from eplb.errors import EplbError
from eplb.formats import load_trace
from eplb.stats.calibration import calibration_stats, contiguous_imbalance, layer_correlation, phase_correlation
from eplb.stats.synth import SynthSettings, generate, route_tokens, topic_shift_stats

SHIPPED = Path(__file__).resolve().parents[2] / "traces" / "deepseek.npz"
SMALL = dict(num_windows=4, tokens_per_window=64, num_hidden_layers=5, first_moe_layer=1,
             num_experts=32, phase_run=(1, 2))


@pytest.fixture(scope="module")
def shipped():
    return load_trace(SHIPPED)


def test_shipped_trace_shape_and_provenance(shipped):
    assert shipped.num_windows >= 32
    assert shipped.counts_TLE.shape[1:] == (58, 256)
    assert shipped.layer_ids.tolist() == list(range(3, 61))
    m = shipped.meta
    assert m["synthetic"] is True and m["num_hidden_layers"] == 61
    assert m["top_k"] == 8 and m["num_expert_groups"] == 8
    assert "eplb.stats.synth" in m["source"] and "seed=0" in m["source"] and "calibrated" in m["source"]
    # every token is routed to exactly top_k experts in every layer
    assert (shipped.counts_TLE.sum(axis=2) == m["tokens_per_window"] * m["top_k"]).all()
    assert SHIPPED.stat().st_size < 2_000_000


def test_shipped_trace_skew_in_calibration_ranges(shipped):
    # Ranges measured on SGLang's real DeepSeek-V3 statistics (traces/README.md).
    s = calibration_stats(shipped.total())
    assert 5.0 <= s["hot_median"] <= 8.0
    assert s["hot_max"] <= 15.0
    assert 0.32 <= s["gini_median"] <= 0.44
    assert 0.7 <= phase_correlation(shipped) <= 0.9


def test_shipped_trace_contiguous_imbalance_in_real_ranges(shipped):
    # Busiest/mean GPU of contiguous placement, median over layers; ranges over SGLang's 8 real
    # DeepSeek-V3 workloads (traces/README.md). Few GPUs see the coarse structure (id trend).
    s = calibration_stats(shipped.total())
    assert 1.32 <= s["contig_G4"] <= 1.64
    assert 1.45 <= s["contig_G8"] <= 1.99
    assert s["contig_G4"] < s["contig_G8"] < s["contig_G16"] < s["contig_G32"]


def test_id_trend_makes_low_expert_ids_hotter():
    kw = dict(SMALL, num_windows=2, tokens_per_window=512, num_hidden_layers=9, skew=0.3, group_skew=0.0)
    flat = generate(SynthSettings(**kw, id_trend=0.0)).total()
    trend = generate(SynthSettings(**kw, id_trend=1.0)).total()
    half = flat.shape[1] // 2
    # the trend moves load from the high ids to the low ids, so the first half of the GPUs (and
    # contiguous imbalance at 2 GPUs) grows; without it both halves carry about the same load
    assert trend[:, :half].sum() > 1.5 * trend[:, half:].sum()
    assert 0.8 < flat[:, :half].sum() / flat[:, half:].sum() < 1.25
    assert contiguous_imbalance(trend, 2) > contiguous_imbalance(flat, 2)


def test_shipped_trace_drifts_and_switches_phase(shipped):
    phases = shipped.meta["phases"]
    assert set(phases) == {"prefill", "decode"}
    switches = sum(a != b for a, b in zip(phases, phases[1:]))
    assert switches >= 2
    c = shipped.counts_TLE
    adjacent = [layer_correlation(c[t], c[t + 1]) for t in range(len(c) - 1)]
    # windows are similar but never identical: gradual drift plus sampling noise
    assert 0.8 < np.median(adjacent) < 0.995


def test_generation_is_deterministic():
    a = generate(SynthSettings(**SMALL, seed=3, keep_tokens=5))
    b = generate(SynthSettings(**SMALL, seed=3, keep_tokens=5))
    np.testing.assert_array_equal(a.counts_TLE, b.counts_TLE)
    np.testing.assert_array_equal(a.topk_ids_NLK, b.topk_ids_NLK)
    assert a.meta == b.meta
    c = generate(SynthSettings(**SMALL, seed=4))
    assert not np.array_equal(a.counts_TLE, c.counts_TLE)


def test_kept_tokens_agree_with_counts():
    t = generate(SynthSettings(**SMALL, keep_tokens=64))  # keep every token
    assert t.topk_ids_NLK.shape == (4 * 64, 4, 8)
    for w in range(4):
        rows = t.topk_ids_NLK[t.token_window_N == w]
        for layer in range(4):
            np.testing.assert_array_equal(np.bincount(rows[:, layer].ravel(), minlength=32), t.counts_TLE[w, layer])


def naive_route(score_E, s):
    """DeepSeek-V3 group-limited top-k for one token, written plainly."""
    per = s.num_experts // s.num_expert_groups
    groups = score_E.reshape(s.num_expert_groups, per)
    gscore = np.sort(groups, axis=1)[:, -2:].sum(axis=1)
    keep = np.argsort(-gscore, kind="stable")[: s.topk_groups]
    masked = np.full_like(score_E, -np.inf)
    for g in keep:
        masked[g * per:(g + 1) * per] = score_E[g * per:(g + 1) * per]
    return set(np.argsort(-masked, kind="stable")[: s.top_k].tolist())


def test_route_tokens_matches_plain_group_limited_routing():
    s = SynthSettings(num_experts=32, num_expert_groups=8, topk_groups=4, top_k=8)
    logit = np.random.default_rng(0).normal(size=32)
    top = route_tokens(logit, 200, s, np.random.default_rng(7))
    # recompute the same noise to route the tokens one by one
    x = np.random.default_rng(7).standard_exponential((200, 32), dtype=np.float32)
    score = logit.astype(np.float32)[None] - np.log(x)
    for n in range(200):
        assert set(top[n].tolist()) == naive_route(score[n], s)
        assert len(set((top[n] // 4).tolist())) <= 4  # at most topk_groups groups used


@pytest.mark.parametrize("kw, message", [
    (dict(num_experts=30), "divisible by num_expert_groups"),
    (dict(topk_groups=9), "topk_groups"),
    (dict(top_k=200), "top_k"),
    (dict(phase_share=0.8, drift_share=0.3), "sum to <= 1"),
    (dict(phase_run=(3, 2)), "phase_run"),
    (dict(keep_tokens=10**6), "keep_tokens"),
    (dict(first_moe_layer=61), "first_moe_layer"),
    (dict(id_trend=-0.1), "id_trend"),
    (dict(id_trend=float("inf")), "id_trend must be a finite number, got inf"),
    (dict(skew=float("nan")), "skew must be a finite number, got nan"),
    (dict(num_windows=2.5), "num_windows must be a whole number, got 2.5"),  # was accepted as 2.5
    (dict(seed=1.5), "seed must be a whole number, got 1.5"),
    (dict(tokens_per_window="8"), "tokens_per_window must be a whole number, got '8'"),  # was a TypeError
    (dict(skew="a"), "skew must be a number, got 'a'"),
    (dict(phase_run=(3, 4.5)), "phase_run must be two whole numbers"),
    (dict(skew=-1.0), r"skew \(-1.0\), skew_spread \(0.05\) and group_skew \(0.1\) must be >= 0"),
])
def test_bad_settings(kw, message):
    with pytest.raises(EplbError, match=message):
        SynthSettings(**kw)


def test_phase_correlation_needs_both_phases():
    t = generate(SynthSettings(**{**SMALL, "phase_run": (9, 9)}))
    with pytest.raises(EplbError, match="only one phase"):
        phase_correlation(t)


def test_cli_writes_a_loadable_trace(tmp_path, capsys):
    out = tmp_path / "s.npz"
    assert main(["synth", "-o", str(out), "--windows", "2", "--tokens", "16", "--seed", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["settings"]["seed"] == 1
    t = load_trace(out)
    assert t.num_windows == 2 and t.meta["synthetic"] is True
    assert main(["synth", "-o", str(out), "--windows", "0"]) == 2
    assert "num_windows must be >= 1" in capsys.readouterr().err
    assert main(["synth", "-o", str(tmp_path / "no" / "s.npz"), "--windows", "1", "--tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "cannot write the trace to" in err and "existing, writable folder" in err and "Traceback" not in err


TOPIC = dict(num_windows=12, tokens_per_window=1024, num_hidden_layers=9, first_moe_layer=1, num_experts=64,
             top_k=2, num_expert_groups=1, topk_groups=1, skew=1.0, phase_share=0.0, topic_shifts=2,
             topic_layers=0.5, seed=3)


def test_topic_shifts_turn_cold_experts_hot():
    t = generate(SynthSettings(**TOPIC))
    topics = t.meta["topics"]
    assert topics[0] == 0 and topics[-1] == 2 and topics == sorted(topics)
    st = topic_shift_stats(t)
    assert st and {d["window"] for d in st} == {w for w in range(1, 12) if topics[w] != topics[w - 1]}
    before = np.array([d["before"] for d in st])
    after = np.array([d["after"] for d in st])
    # calibrated as real topic shifts: an expert under 0.3% of the tokens takes 20-30% after
    assert np.median(before) < 0.003
    assert 0.17 <= np.median(after) <= 0.33
    assert (after > 10 * np.maximum(before, 1e-3)).all()


def test_topic_shifts_leave_the_rest_of_the_trace_unchanged():
    with_shifts = generate(SynthSettings(**TOPIC))
    without = generate(SynthSettings(**{**TOPIC, "topic_shifts": 0}))
    first = with_shifts.meta["topics"].index(1)
    # own generator: the windows before the first shift are the same draws
    np.testing.assert_array_equal(with_shifts.counts_TLE[:first], without.counts_TLE[:first])
    assert not np.array_equal(with_shifts.counts_TLE[first:], without.counts_TLE[first:])
    # a trace without shifts records no topic settings (the shipped trace is remade byte for byte)
    assert "topics" not in without.meta and "topic_shifts" not in without.meta["synth_settings"]
    again = generate(SynthSettings(**TOPIC))
    np.testing.assert_array_equal(with_shifts.counts_TLE, again.counts_TLE)


@pytest.mark.parametrize("kw, message", [
    (dict(topic_shifts=40), "topic_shifts"),
    (dict(topic_layers=0.0), "topic_layers"),
    (dict(topic_hot=(0.3, 0.2)), "topic_hot"),
    (dict(topic_cold=0.5), "topic_cold"),
])
def test_bad_topic_settings(kw, message):
    with pytest.raises(EplbError, match=message):
        SynthSettings(**kw)


def test_cli_topic_shifts_and_set(tmp_path, capsys):
    out = tmp_path / "t.npz"
    args = ["synth", "-o", str(out), "--windows", "6", "--tokens", "256", "--topic-shifts", "1",
            "--set", "num_experts=32", "--set", "num_hidden_layers=5", "--set", "first_moe_layer=1",
            "--set", "top_k=2", "--set", "num_expert_groups=1", "--set", "topk_groups=1",
            "--set", "topic_hot=0.2,0.3", "--set", "skew=1.0"]
    assert main(args) == 0
    assert "topic shifts" in capsys.readouterr().out
    t = load_trace(out)
    assert t.meta["synth_settings"]["topic_hot"] == [0.2, 0.3] and t.num_logical_experts == 32
    assert main(["synth", "-o", str(out), "--set", "nope=1"]) == 2
    assert "not a generator setting" in capsys.readouterr().err
    assert main(["synth", "-o", str(out), "--set", "topic_hot=0.2"]) == 2
    assert "topic_hot" in capsys.readouterr().err
