"""Engine dispatch rules (SGLang static / dynamic), the engine table and the rule-aware planner.

SGLang's own functions are compared with these models in tests/engines (when SGLang is
installed); here: the rules' invariants on small seeded placements, hand-checked cases, and
planning for a rule.
"""

import numpy as np
import pytest

from eplb.core.placement import Placement
from eplb.core.trace import Trace, default_meta
from eplb.dispatch.rules import ENGINES, EvenSplit, engine_rule, get_rule
from eplb.dispatch.sglang import SglangDynamic, SglangStatic, static_dispatch_maps
from eplb.dispatch.sglang_lp import SglangLp
from eplb.errors import EplbError
from eplb.formats import save_trace
from eplb.formats.deepseek import from_deepseek, replica_ranks, to_deepseek
from eplb.planning.front_door import plan
from eplb.stats.loads import imbalance
from planners.deepseek import rebalance_experts
from tests.placements import spread_placement


def _placement(rng, L=3, E=12, G=4, N=2, S=4):
    return spread_placement(rng, L, E, G, N, S)


@pytest.mark.parametrize("path", ["startup", "rebalance"])
def test_static_maps_respect_sglang_preferences(rng, path):
    p = _placement(rng)
    maps_GLE = static_dispatch_maps(p, path=path)
    G, L, E = maps_GLE.shape
    assert (G, L, E) == (p.num_gpus, p.num_layers, p.num_logical_experts)
    S, per_node = p.slots_per_gpu, p.num_gpus // p.num_nodes
    for l in range(L):
        for e in range(E):
            slots = np.flatnonzero(p.phy2log_LP[l] == e)
            for g in range(G):
                pick = maps_GLE[g, l, e]
                assert p.phy2log_LP[l, pick] == e  # never a wrong slot
                own = slots[slots // S == g]
                node = slots[(slots // S) // per_node == g // per_node]
                if len(slots) == 1:
                    assert pick == slots[0]
                elif len(own):
                    assert pick == own[0]  # same GPU first
                elif 0 < len(node) < len(slots):
                    assert pick == node[0]  # then the first replica on the node


def test_static_shares_are_ranks_over_gpus(rng):
    p = _placement(rng)
    w_LP = SglangStatic().bind(p)(None)
    sums = np.zeros((p.num_layers, p.num_logical_experts))
    np.add.at(sums, (np.arange(p.num_layers)[:, None], p.phy2log_LP), w_LP)
    assert np.allclose(sums, 1.0)
    assert np.allclose(w_LP * p.num_gpus, np.rint(w_LP * p.num_gpus))  # whole ranks per replica


def test_rebalance_path_splits_drawing_ranks_fairly():
    # 8 GPUs on 2 nodes, 2 slots each: expert 0 on GPUs 0 and 1 (node 0 holds both), so the
    # other 6 ranks draw; coordinated draws give each replica 3 of them, so 4 ranks each.
    E, G, N = 15, 8, 2
    row = [0, 1, 0, 2] + list(range(3, 15))
    p = Placement(np.array([row]), G, E, N)
    w = SglangStatic(path="rebalance").bind(p)(None)[0]
    assert w[0] == pytest.approx(4 / 8) and w[2] == pytest.approx(4 / 8)


def test_one_replica_per_node_keeps_tokens_on_the_node():
    # Expert 0 on GPU 0 (node 0) and GPU 2 (node 1): every rank has a replica on its node,
    # nothing is drawn, and each replica takes its node's ranks: 1/2 each under every rule.
    E, G, N = 7, 4, 2
    row = [0, 1, 2, 3, 0, 4, 5, 6]
    p = Placement(np.array([row]), G, E, N)
    for rule in (SglangStatic(), SglangStatic(path="rebalance"), SglangDynamic(), SglangDynamic(path="rebalance")):
        w = rule.bind(p)(None)[0]
        assert w[0] == pytest.approx(0.5) and w[4] == pytest.approx(0.5), rule


def test_dynamic_startup_keeps_holder_tokens_local():
    # Expert 0 on GPUs 0 and 1 of node 0 (of 2 nodes): ranks 0 and 1 keep theirs, ranks 2
    # and 3 draw uniformly: each replica gets 1/4 + 2 x 1/8 = 1/2. Rebalance: even.
    E, G, N = 7, 4, 2
    row = [0, 1, 0, 2, 3, 4, 5, 6]
    p = Placement(np.array([row]), G, E, N)
    w = SglangDynamic().bind(p)(None)[0]
    assert w[0] == pytest.approx(0.5) and w[2] == pytest.approx(0.5)
    row = [0, 1, 0, 2, 0, 3, 4, 5]  # three replicas, two on node 0: node 1's ranks use GPU 2's
    E = 6
    p = Placement(np.array([row]), G, E, N)
    w = SglangDynamic().bind(p)(None)[0]
    assert (w[0], w[2], w[4]) == pytest.approx((0.25, 0.25, 0.5))


def test_engine_table_and_errors():
    assert isinstance(engine_rule("vllm"), EvenSplit) and isinstance(engine_rule("trtllm"), EvenSplit)
    assert isinstance(engine_rule("sglang"), SglangStatic)
    assert isinstance(engine_rule("sglang", "dynamic"), SglangDynamic)
    assert get_rule("sglang-static") == SglangStatic()
    with pytest.raises(EplbError, match="unknown engine 'tgi'.*sglang, vllm, trtllm"):
        engine_rule("tgi")
    assert isinstance(engine_rule("sglang", "lp"), SglangLp) and get_rule("sglang-lp") == SglangLp()
    with pytest.raises(EplbError, match="no dispatch mode 'fast'.*static, dynamic, lp"):
        engine_rule("sglang", "fast")
    with pytest.raises(EplbError, match="no dispatch mode 'lp': it splits each expert's tokens evenly"):
        engine_rule("vllm", "lp")
    with pytest.raises(EplbError, match="unknown SGLang map path"):
        SglangStatic(path="later")
    assert set(ENGINES) == {"sglang", "vllm", "trtllm"}


def _loads(rng, L=4, E=32):
    """Skewed loads whose hottest expert needs no more replicas than there are nodes."""
    return np.floor(rng.lognormal(0.0, 0.8, (L, E)) * 100) + 1


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_rule_aware_plan_is_served_as_planned(rng, mode):
    load = _loads(rng)
    rule = engine_rule("sglang", mode)
    r = plan(load, num_gpus=8, num_nodes=4, num_redundant=8, dispatch=rule)
    assert r.planner == "rule-aware" and r.dispatch.name == rule.name
    assert r.served is r.after and r.placement.metrics["dispatch"] == rule.name  # scored under the rule
    assert plan(load, num_gpus=8, num_nodes=4, num_redundant=8).planner == "greedy"  # no rule: greedy
    assert r.info["served_matches_plan"]
    # Replicas of an expert sit on distinct nodes (what keeps the draws fixed while packing).
    node_LP = (np.arange(r.placement.num_slots) // r.placement.slots_per_gpu) // 2
    for l in range(load.shape[0]):
        for e in range(32):
            nodes = node_LP[r.placement.phy2log_LP[l] == e]
            assert len(nodes) == len(set(nodes.tolist()))
    greedy = plan(load, num_gpus=8, num_nodes=4, num_redundant=8, planner="greedy", dispatch=rule)
    assert np.median(r.served.imbalance_L) <= np.median(greedy.served.imbalance_L) + 1e-9
    served = imbalance(r.placement.gpu_loads(load, rule.bind(r.placement)(None)))
    assert np.allclose(served, r.served.imbalance_L)
    assert np.allclose(imbalance(r.placement.gpu_loads(load)), r.planned.imbalance_L)  # the even split
    own = plan(load, num_gpus=8, num_nodes=4, num_redundant=8)
    assert own.served is None and own.planned is own.after and "dispatch" not in own.placement.metrics


def test_rule_aware_against_windows_and_on_one_node(rng):
    hist = np.stack([_loads(rng) for _ in range(3)])
    r = plan(hist, num_gpus=8, num_nodes=2, num_redundant=8, dispatch="sglang-static")
    assert r.info["windows"] == 3 and r.info["served_matches_plan"]
    one = plan(hist[0], num_gpus=4, num_nodes=1, num_redundant=4, dispatch="sglang-static")
    assert one.info["units"] == 4 and one.info["served_matches_plan"]
    even = plan(hist[0], num_gpus=4, num_redundant=4, planner="rule-aware")
    assert even.info["scope"] == "free"
    with pytest.raises(EplbError, match="static rules"):
        plan(hist[0], num_gpus=4, num_redundant=4, planner="rule-aware", dispatch="resplit")


def test_to_deepseek_orders_columns_by_replica_rank(rng):
    load = _loads(rng, L=2, E=12)
    phy, l2p, cnt, _ = rebalance_experts(load, 16, 4, 2, 8)
    p = from_deepseek(phy, l2p, cnt, num_gpus=8, num_nodes=2)
    mine = to_deepseek(p, replica_rank_LP=replica_ranks(phy, l2p))
    assert all(np.array_equal(a, b) for a, b in zip(mine, (phy, l2p, cnt)))
    assert mine[1].shape[2] == cnt.max()  # DeepSeek pads to the largest replica count
    default = to_deepseek(p)[1]  # slot order: the lowest slot is rank 0
    key = np.where(default >= 0, default, 10**9)
    assert (np.sort(key, axis=2) == key).all()
    with pytest.raises(EplbError, match="replica_rank_LP"):
        to_deepseek(p, replica_rank_LP=np.zeros_like(phy))


@pytest.fixture
def trace_file(tmp_path, rng):
    counts = rng.poisson(rng.lognormal(3.0, 0.8, size=(1, 4, 32)), size=(3, 4, 32))
    path = tmp_path / "trace.npz"
    save_trace(Trace(counts, np.arange(1, 5), default_meta(5, 32, top_k=4)), path)
    return str(path)


def test_cli_plan_reports_what_the_engine_serves(trace_file, tmp_path, capsys):
    import json

    from eplb.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", trace_file, "--gpus", "8", "--nodes", "4", "--engine", "sglang", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "rule-aware, served by sglang (sglang-static)" in text and "(sglang)" in text
    assert list(json.loads(out.read_text())) == ["physical_to_logical_map"]  # the engine's format by default
    assert main(["plan", trace_file, "--gpus", "8", "--nodes", "4", "-p", "greedy", "--format", "sglang",
                 "-o", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["dispatch"] == "sglang-static" and summary["served"]["imbalance"]["max"] >= 1.0
    assert main(["plan", trace_file, "--gpus", "8", "--engine", "vllm", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dispatch"] == "even"


@pytest.mark.parametrize("argv, message", [
    (["--engine", "tgi"], "invalid choice: 'tgi'"),
    (["--engine", "sglang", "--dispatch", "fast"], "no dispatch mode 'fast': its modes are static, dynamic, lp"),
    (["--engine", "vllm", "--dispatch", "resplit"], "engine 'vllm' has no dispatch mode 'resplit': it splits each "
                                                     "expert's tokens evenly (modes: even); to plan for a per-batch "
                                                     "re-split serve with --engine sglang --dispatch lp"),
    (["--engine", "trtllm", "--dispatch", "lp"], "engine 'trtllm' has no dispatch mode 'lp'"),
    (["--dispatch", "lp"], "--dispatch lp is a mode of an engine: add --engine (sglang, vllm, trtllm); without "
                           "--engine only --dispatch resplit"),
    (["--dispatch", "static"], "--dispatch static is a mode of an engine: add --engine"),
    (["--engine", "vllm", "--format", "sglang", "-o", "x.json"], "--engine vllm does not read --format sglang"),
    (["--engine", "sglang", "-p", "ilp"], "--planner ilp models a weighted or an even split"),
    (["--engine", "vllm", "-p", "ilp", "--set", "dispatch=weighted"], "carries no weights"),
])
def test_cli_engine_errors(trace_file, argv, message, capsys):
    from eplb.cli import main

    assert main(["plan", trace_file, "--gpus", "8", "--nodes", "4"] + argv) == 2
    assert message in capsys.readouterr().err
