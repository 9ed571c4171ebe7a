"""Models with few experts (issue 11): every planner and every command on three real shapes.

Legend: L = MoE layers, E = logical experts, K = top-k, G = GPUs, S = slots per GPU.

- Mixtral 8x7B: E = 8, top-2, no expert groups; G up to 16 (more GPUs than experts, S = 2);
- OLMoE: E = 64, top-8, no expert groups; G = 16 on 2 nodes;
- Llama-4 Maverick / Switch: E = 128, top-1; G up to 256 (S = 1).
Traces are seeded synthetic ones of those shapes (eplb synth), a few layers each. The
planners are held to the invariants of tests/unit/test_planners.py (every expert placed,
slots filled, never two replicas of one expert on a GPU unless a planner declares it, never
below the lower bound); the commands must exit 0 and write files that read back.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout

import numpy as np
import pytest

import eplb
from eplb.cli import main
from eplb.core.topology import Topology
from eplb.formats.export import read_placement
from eplb.stats import synth
from planners.api import PlanRequest, get_planner, planner_names
from tests.unit.test_planners import check_invariants, fast_settings, is_time_limited

# name: (E, top-k, hidden layers, first MoE layer, [(G, S or None, nodes), ...])
SHAPES = {
    "mixtral": (8, 2, 4, 0, [(4, None, 1), (8, None, 2), (16, 2, 1)]),
    "olmoe": (64, 8, 4, 0, [(8, None, 1), (16, None, 2)]),
    "llama4": (128, 1, 5, 1, [(32, None, 1), (256, 1, 1)]),
}


def shape_settings(name: str, windows: int = 3, tokens: int = 256) -> synth.SynthSettings:
    E, K, H, first, _ = SHAPES[name]
    return synth.SynthSettings(num_windows=windows, tokens_per_window=tokens, num_hidden_layers=H,
                               first_moe_layer=first, num_experts=E, top_k=K, num_expert_groups=1, topk_groups=1,
                               seed=3)


@pytest.fixture(scope="module")
def traces():
    return {name: synth.generate(shape_settings(name)) for name in SHAPES}


CASES = [(shape, planner, topo) for shape, (_, _, _, _, topos) in SHAPES.items() for planner in planner_names()
         for topo in topos]


@pytest.mark.parametrize("shape, planner, topo", CASES, ids=[f"{s}-{p}-G{t[0]}" for s, p, t in CASES])
def test_every_planner_on_few_expert_shapes(traces, shape, planner, topo):
    trace = traces[shape]
    G, S, N = topo
    E = trace.num_logical_experts
    topology = Topology.for_experts(E, num_gpus=G, num_nodes=N, slots_per_gpu=S)
    history = trace.counts_TLE.astype(np.float64)
    if is_time_limited(planner):
        history = history[:, :1]  # one layer: the solver's time limit is per call
    load = history.sum(axis=0)
    sol = get_planner(planner, **fast_settings(planner)).plan(PlanRequest(load, topology, history_TLE=history))
    check_invariants(planner, sol.phy2log_LP, sol.dispatch_weights_LP, load, topology)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_front_door_migration_and_rebalancer_on_few_expert_shapes(traces, shape):
    trace = traces[shape]
    G, S, N = SHAPES[shape][4][-1]  # the largest: more GPUs than experts where the shape has it
    first = eplb.plan(trace.windows(0, 2), num_gpus=G, slots_per_gpu=S, num_nodes=N)
    again = eplb.plan(trace.windows(1, 3), num_gpus=G, slots_per_gpu=S, num_nodes=N, previous=first.placement,
                      budget=eplb.Budget(max_moves=4))
    assert again.info["migration"]["moves"] <= 4
    rb = eplb.Rebalancer(first.placement, window=2, interval=1, min_improvement=0.0)
    for counts_LE in trace.counts_TLE:
        rb.observe(counts_LE)
    res = rb.rebalance()
    assert res.placement.num_gpus == G and (res.placement.replica_count_LE >= 1).all()


def run(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


# One plot kind per shape keeps the figures (the slow part) few; every kind is drawn once.
PLOTS = {"mixtral": ["balance", "backtest"], "olmoe": ["replicas"], "llama4": ["heatmap"]}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_command_on_few_expert_shapes(tmp_path, shape):
    E, K, H, first, topos = SHAPES[shape]
    G, S, N = topos[-1]
    size = ["--gpus", G, "--nodes", N] + (["--slots-per-gpu", S] if S else [])
    t = tmp_path / "t.npz"
    rc, _, err = run(["synth", "-o", t, "--windows", 3, "--tokens", 256, "--experts", E, "--top-k", K,
                      "--expert-groups", 1, "--hidden-layers", H, "--first-moe-layer", first, "-q"])
    assert rc == 0, err
    rc, out, err = run(["stats", t, "--json"])
    assert rc == 0 and json.loads(out)["gpus"] == min(32, E), err
    plan = tmp_path / "plan.json"
    rc, out, err = run(["plan", t, *size, "-p", "greedy", "-o", plan, "--json"])
    assert rc == 0 and json.loads(out)["num_slots"] == G * (S or -(-E // G) + 1), err
    for fmt, name in (("sglang", "loc.json"), ("trtllm", "lb.yaml")):
        assert run(["plan", t, *size, "-p", "greedy", "-f", fmt, "-o", tmp_path / name, "-q"])[0] == 0
        back = read_placement(tmp_path / name, fmt, num_gpus=G, num_nodes=N, layer_ids=np.arange(first, H))
        assert back == eplb.load_placement(plan).with_weights(None)
    assert run(["plan", t, *size, "--previous", plan, "-p", "greedy", "-q"])[0] == 0
    rc, out, err = run(["inspect", plan, "--trace", t, "--json"])
    assert rc == 0 and json.loads(out)["num_gpus"] == G, err
    bt = tmp_path / "bt.json"
    rc, _, err = run(["backtest", t, *size, "-p", "greedy", "--no-oracle", "-q", "-o", bt])
    assert rc == 0 and json.loads(bt.read_text())["results"], err
    assert run(["capacity", "--layers", H, "--dense-layers", first, "--hidden", 1024, "--vocab", 32000, "--heads", 16,
                "--kv-heads", 4, "--head-dim", 64, "--intermediate", 4096, "--experts", E,
                "--expert-intermediate", 1024, "--top-k", K, "--gpus", G, "--gpu-memory", "80GiB",
                "--context", 4096, "--concurrency", 64, "-q"])[0] == 0
    for kind in PLOTS[shape]:
        args = {"heatmap": [t], "balance": [t, "--gpus", G, "--nodes", N, "-p", "greedy", "--placement", plan],
                "replicas": [plan, "--trace", t], "backtest": [bt]}[kind]
        rc, _, err = run(["plot", kind, *args, "-o", tmp_path / f"{kind}.png", "-q"])
        assert rc == 0 and (tmp_path / f"{kind}.png").stat().st_size > 1000, err
