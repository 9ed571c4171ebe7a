"""Hardware profiles, the roofline + all-to-all cost model and the time objective (no torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import eplb
from eplb.core.hardware import PROFILES, get_hardware
from eplb.core.placement import Placement
from eplb.core.topology import Topology
from eplb.dispatch.cost import (
    CostModel,
    TimeObjective,
    assign_pairs,
    check_objective,
    cost_model,
    expected_replica_seconds,
    row_link_seconds,
    slot_rows,
    step_cost,
)
from eplb.errors import EplbError
from eplb.stats.capacity import get_model

# Hardware profiles -------------------------------------------------------------------------------


def test_presets_have_sources_and_dense_figures():
    for name, hw in PROFILES.items():
        assert hw.source, name
        assert hw.hbm_bytes_per_s > 0 and hw.nvlink_bytes_per_s > 0 and hw.internode_bytes_per_s > 0
    # Spec sheets: H200 = H100's tensor cores (1,979 BF16 TFLOP/s with sparsity: 989.5 dense) with 4.8 TB/s HBM3e.
    assert PROFILES["h200"].flops("bf16") == PROFILES["h100"].flops("bf16") == 989.5e12
    assert PROFILES["h200"].flops("fp8") == 2 * PROFILES["h200"].flops("bf16")
    assert PROFILES["h200"].hbm_bytes_per_s == 4.8e12 and PROFILES["b200"].hbm_bytes_per_s == 8e12


def test_unknown_hardware_lists_the_known_ones():
    with pytest.raises(EplbError, match="unknown hardware 'a100'.*h100, h200, b200, cpu"):
        get_hardware("a100")


def test_profile_file_round_trip_and_base(tmp_path):
    path = tmp_path / "mine.json"
    PROFILES["h100"].save(path)
    assert get_hardware(str(path)) == PROFILES["h100"]
    yaml_path = tmp_path / "mine.yaml"
    yaml_path.write_text("base: h200\nhbm_bytes_per_s: 4.0e12\nname: derated H200\n")
    hw = get_hardware(yaml_path)
    assert hw.hbm_bytes_per_s == 4.0e12 and hw.flops("fp8") == PROFILES["h200"].flops("fp8")
    assert hw.name == "derated H200"


@pytest.mark.parametrize("fields, message", [
    ({"flops_per_s": {"fp8": 1e15}, "hbm_bytes_per_s": 1e12}, "missing field.*nvlink_bytes_per_s, internode"),
    ({"flops_per_s": {"fp8": 1e15}, "hbm_bytes_per_s": 0, "nvlink_bytes_per_s": 1e11, "internode_bytes_per_s": 1e10},
     "hbm_bytes_per_s must be a finite number > 0, got 0"),
    ({"flops_per_s": {"fp8": -1}, "hbm_bytes_per_s": 1, "nvlink_bytes_per_s": 1, "internode_bytes_per_s": 1},
     r"flops_per_s.fp8 must be a finite number > 0, got -1"),
    ({"flops_per_s": {"int4": 1e15}, "hbm_bytes_per_s": 1, "nvlink_bytes_per_s": 1, "internode_bytes_per_s": 1},
     "flops_per_s.int4: unknown dtype"),
    ({"base": "h200", "a2a_latency_s": -1e-6}, "a2a_latency_s must be a finite number >= 0"),
    ({"base": "h200", "hbm": 1}, "unknown field.*hbm"),
    ({"base": "tpu"}, "base 'tpu' is not a preset"),
])
def test_bad_profile_names_the_field(tmp_path, fields, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(fields))
    with pytest.raises(EplbError, match=message):
        get_hardware(str(path))


def test_profile_without_the_dtype_is_refused():
    with pytest.raises(EplbError, match="no FLOP/s figure for fp8: it gives fp32"):
        cost_model("deepseek-v3", "cpu")


# Roofline -----------------------------------------------------------------------------------------


def test_deepseek_v3_expert_on_h200_golden_figures():
    cost = cost_model("deepseek-v3", "h200")
    assert cost.weight_bytes == 3 * 7168 * 2048                      # fp8: one byte per weight
    t1 = cost.replica_seconds(1)
    stream = 3 * 7168 * 2048 / 4.8e12                                # 9.18 us to stream the weights
    assert t1 == pytest.approx(2e-6 + stream + 7168 * 3 / 4.8e12)
    # Far above the ridge it is FLOPs: 2 x 3 x D x F per row at 1,979 TFLOP/s.
    assert cost.replica_seconds(100_000) == pytest.approx(2e-6 + 100_000 * 6 * 7168 * 2048 / 1979e12)
    knee = cost.knee_rows()
    hw = cost.hardware
    assert knee * cost.flops_per_row / hw.flops("fp8") == pytest.approx(
        (cost.weight_bytes + knee * cost.row_bytes) / hw.hbm_bytes_per_s)
    assert cost.replica_seconds(0) == 0.0


def test_slot_rows_whole_rows_and_same_gpu_copies():
    # 2 GPUs x 3 slots; expert 0 on both GPUs, expert 1 twice on GPU 0.
    p = Placement(np.array([[0, 1, 1, 0, 2, 3]]), 2, 4)
    rows = slot_rows(p, np.array([[3.0, 5.0, 2.0, 1.0]]))
    assert rows.tolist() == [[2.0, 5.0, 0.0, 1.0, 2.0, 1.0]]         # 3 over two replicas: 2 + 1
    rows = slot_rows(p, np.array([[1.0, 0.0, 0.0, 0.0]]))
    assert rows[0, [0, 3]].tolist() in ([1.0, 0.0], [0.0, 1.0])       # one row wakes one replica
    frac = slot_rows(p, np.array([[1.5, 0.0, 0.0, 0.0]]))
    assert frac[0, [0, 3]].tolist() == [0.75, 0.75]                   # expected loads are split as they are


def test_per_token_traffic_counts_each_destination_gpu_once():
    # 4 GPUs on 2 nodes, one slot each: expert e on GPU e.
    model = get_model("deepseek-v3")
    cost = CostModel(model, PROFILES["h200"])
    p = Placement(np.arange(4)[None], 4, 4, num_nodes=2)
    # Token 0 sits on GPU 0 and picks experts 0, 1 (own GPU, same node); token 1 on GPU 1 picks
    # 2, 3 (both on the other node: two destinations).
    topk = np.array([[[0, 1]], [[2, 3]]])
    rows = slot_rows(p, np.array([[1.0, 1.0, 1.0, 1.0]]))
    pairs = assign_pairs(p, topk, rows)
    s = step_cost(cost, p, rows, 2, pairs)
    per_token = model.hidden_size * (1 + 2)                          # fp8 there, bf16 back
    assert s.intra_bytes_per_token_L[0] == pytest.approx(per_token * 1 / 2)
    assert s.inter_bytes_per_token_L[0] == pytest.approx(per_token * 2 / 2)


def _sampled_vs_expected(topk, E, G, N=2, seed=0):
    cost = cost_model("deepseek-v3", "h200")
    p = Placement(np.random.default_rng(seed).permutation(E)[None], G, E, num_nodes=N)
    counts = np.bincount(topk.ravel(), minlength=E)[None].astype(float)
    rows = slot_rows(p, counts)
    B = len(topk)
    total = lambda s: (s.intra_bytes_per_token_L + s.inter_bytes_per_token_L)[0]  # noqa: E731
    return total(step_cost(cost, p, rows, B)), total(step_cost(cost, p, rows, B, assign_pairs(p, topk, rows)))


def test_expected_traffic_is_the_independence_expectation():
    """Counts-only traces: the bytes are the expectation when every expert is picked
    independently (checked against tokens drawn that way), and within a few per cent of tokens
    that pick K distinct experts (the real router), which touch slightly more GPUs."""
    from eplb.dispatch.cost import _expected_hits

    rng = np.random.default_rng(0)
    E, G, B = 64, 8, 20000
    pop = rng.pareto(1.5, E) + 0.1
    q = np.minimum(6 * pop / pop.sum(), 0.9)
    gpu = rng.permutation(E) % G
    picks = rng.random((B, E)) < q                                   # every expert picked independently
    hit_G = np.stack([picks[:, gpu == g].any(axis=1) for g in range(G)], axis=1).mean(axis=0)
    rows_P = (q * B)[np.argsort(gpu, kind="stable")]                 # slots grouped by GPU
    np.testing.assert_allclose(_expected_hits(rows_P[None], G, B)[0], hit_G, atol=0.01)
    logits = np.log(pop)[None] + rng.gumbel(size=(B, E))
    distinct = np.argpartition(-logits, 6, axis=1)[:, :6][:, None, :]  # 6 distinct experts per token
    expected, exact = _sampled_vs_expected(distinct, E, G)
    assert 0.9 * exact < expected <= exact


def test_layer_time_is_a_barrier_or_overlapped():
    p = Placement(np.arange(4)[None], 4, 4)
    counts = np.array([[40.0, 0, 0, 8]])
    for overlap in (False, True):
        cost = CostModel(get_model("deepseek-v3"), PROFILES["h200"], overlap=overlap)
        s = step_cost(cost, p, slot_rows(p, counts), 48)
        comp, comm = s.compute_s_LG.max(), s.dispatch_s_LG.max() + s.combine_s_LG.max()
        assert s.seconds == pytest.approx(max(comp, comm) if overlap else comp + comm)


# Time objective -------------------------------------------------------------------------------------


def test_expected_replica_seconds_matches_sampling():
    cost = cost_model("deepseek-v3", "h200")
    load = np.r_[[1.0, 10.0, 100.0, 1000.0], np.full(252, 50.0)][None]
    rng = np.random.default_rng(1)
    for B in (16, 2000):
        p = 8 * load[0, :4] / load.sum()
        mc = cost.replica_seconds(rng.binomial(B, p, size=(100_000, 4))).mean(axis=0)
        np.testing.assert_allclose(expected_replica_seconds(cost, load, B)[0, :4], mc, rtol=0.02)


def test_planning_load_adds_the_all_to_all_of_each_experts_rows():
    cost = cost_model("deepseek-v3", "h200")
    load = np.r_[[1.0, 10.0, 100.0, 1000.0], np.full(252, 50.0)][None]
    obj = TimeObjective(cost, batch_tokens=4096)
    rows = 4096 * 8 * load / load.sum()
    for nodes in (1, 4):
        topo = Topology(32, 9, nodes)
        link = obj.planning_load(load, topo) - expected_replica_seconds(cost, load, 4096)
        np.testing.assert_allclose(link, rows * row_link_seconds(cost, topo))
    # The inter-node link is the slower: rows from other nodes cost more than rows over NVLink.
    assert row_link_seconds(cost, Topology(32, 9, 4)) > row_link_seconds(cost, Topology(32, 9)) > 0
    assert row_link_seconds(cost, Topology(1, 256)) == 0            # one GPU: every row is local


def test_objective_time_needs_a_cost_model():
    with pytest.raises(EplbError, match="objective 'time' needs a cost model"):
        check_objective("time")
    with pytest.raises(EplbError, match="unknown objective 'speed'"):
        eplb.plan(np.ones((1, 8)), num_gpus=2, objective="speed")


def test_time_objective_plans_and_is_scored_in_tokens():
    rng = np.random.default_rng(2)
    load = np.floor(rng.pareto(1.2, (3, 256)) * 100) + 1
    obj = TimeObjective(cost_model("deepseek-v3", "h200"), batch_tokens=32)
    for planner in ("greedy", "robust"):
        res = eplb.plan(load, num_gpus=8, num_redundant=16, planner=planner, objective=obj)
        assert np.array_equal(res.load_LE, load)                    # token ratios, as always
        assert res.info["objective"]["batch_tokens"] == 32
        assert res.placement.metrics["objective"] == "time"
    default = TimeObjective(cost_model("deepseek-v3", "h200"), phase="prefill")
    assert default.tokens_for(8) == 4096 * 8


def test_time_objective_refuses_another_models_trace():
    obj = TimeObjective(cost_model("deepseek-v2-lite", "h200"))
    with pytest.raises(EplbError, match=r"trace has 2 layers x 256 experts but DeepSeek-V2-Lite has 26 MoE layers"):
        eplb.plan(np.ones((2, 256)), num_gpus=8, objective=obj)


def test_rebalancer_hands_the_objective_to_plan():
    rng = np.random.default_rng(3)
    load = np.floor(rng.pareto(1.2, (2, 256)) * 100) + 1
    obj = TimeObjective(cost_model("deepseek-v3", "h200"), batch_tokens=64)
    start = eplb.plan(load, num_gpus=8, num_redundant=8).placement
    rb = eplb.Rebalancer(start, interval=1, min_improvement=0.0, objective=obj, policy=None)
    rb.observe(load[::-1].copy())
    res = rb.rebalance()
    assert res.placement.metrics.get("objective") == "time"
    with pytest.raises(EplbError, match="needs a cost model"):
        eplb.Rebalancer(start, objective="time")


def test_planning_and_simulating_for_time_never_import_torch():
    code = ("import sys, numpy as np, eplb; from eplb.dispatch.cost import TimeObjective, cost_model; "
            "from eplb.evaluate.simulate import simulate; from eplb.formats import load_trace; "
            "t = load_trace('traces/deepseek.npz').windows(0, 2); c = cost_model('deepseek-v3', 'h200'); "
            "r = eplb.plan(t, num_gpus=16, objective=TimeObjective(c, batch_tokens=32)); "
            "simulate(c, r.placement, t, rule='time', batch_tokens=32, batches_per_window=1); "
            "print('torch' in sys.modules)")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.stdout.strip() == "False"
