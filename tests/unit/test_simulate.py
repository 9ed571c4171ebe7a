"""`eplb simulate`, the batches it scores, and `eplb plan` with the cost model (CLI through main)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

import eplb
from eplb.cli import build_parser, main
from eplb.core.trace import Trace
from eplb.dispatch.cost import cost_model
from eplb.dispatch.rules import RULES
from eplb.errors import EplbError
from eplb.evaluate.simulate import cut_batches, simulate
from eplb.formats import load_placement, load_trace, save_placement

ROOT = Path(__file__).resolve().parents[2]
SYNTH = ROOT / "traces" / "deepseek.npz"


@pytest.fixture(scope="module")
def synth():
    return load_trace(SYNTH).windows(0, 4)


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory, synth):
    path = tmp_path_factory.mktemp("sim") / "plan.json"
    save_placement(eplb.plan(synth, num_gpus=16, num_redundant=16).placement, path)
    return path


def test_batches_from_counts_and_from_tokens(synth):
    batches, how = cut_batches(synth, 8, 32, 3, seed=0)
    assert len(batches) == 12 and "independent expert choices" in how
    assert all(b.counts_LE.sum(axis=1).tolist() == [256] * 58 for b in batches)
    again, _ = cut_batches(synth, 8, 32, 3, seed=0)
    assert all(np.array_equal(a.counts_LE, b.counts_LE) for a, b in zip(batches, again))
    whole, how = cut_batches(synth, 8)
    assert len(whole) == 4 and np.array_equal(whole[0].counts_LE, synth.counts_TLE[0])
    ids = np.random.default_rng(0).integers(0, 256, (100, 58, 8))
    counts = np.stack([np.bincount(ids[:, l].ravel(), minlength=256) for l in range(58)])[None]
    tokens = Trace(counts, synth.layer_ids, dict(synth.meta), ids, np.zeros(100, dtype=np.int32))
    runs, how = cut_batches(tokens, 8, 40, 8)
    assert len(runs) == 2 and "exact all-to-all" in how and runs[0].topk_BLK.shape == (40, 58, 8)
    with pytest.raises(EplbError, match="no window of the trace holds 400 tokens"):
        cut_batches(tokens, 8, 400)
    with pytest.raises(EplbError, match="tokens pick 8 experts each but the model's top-k is 6"):
        cut_batches(tokens, 6)


def test_simulate_bounds_and_report(synth, plan_file):
    cost = cost_model("deepseek-v3", "h200")
    p = load_placement(plan_file)
    rep = simulate(cost, p, synth, rule="time", batch_tokens=64, batches_per_window=2)
    assert (rep.ideal_s_n <= rep.plan_s_n * (1 + 1e-9)).all() and (rep.ideal_s_n <= rep.contiguous_s_n).all()
    s = rep.summary()
    for key in ("moe_step_seconds", "contiguous_moe_step_seconds", "ideal_moe_step_seconds", "straggler_time"):
        assert s[key] > 0
    assert set(s["all_to_all_bytes_per_token"]) == {"intra_node", "inter_node"}
    assert s["dispatch"] == "time" and s["num_batches"] == 8 and len(s["per_layer"]["moe_seconds"]) == 58


def test_cli_simulate_json(plan_file, capsys):
    rc = main(["simulate", str(SYNTH), "--plan", str(plan_file), "--model", "deepseek-v3", "--hardware", "h200",
               "--batch-tokens", "32", "--batches", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["batch_tokens"] == 32 and out["num_windows"] == 32 and out["dispatch"] == "even"
    assert out["ideal_moe_step_seconds"] <= out["moe_step_seconds"]
    assert out["all_to_all_bytes_per_token"]["inter_node"] == 0.0      # one node


def test_cli_simulate_offers_every_dispatch_rule(plan_file, capsys):
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in sub.choices["simulate"]._actions if "--dispatch" in a.option_strings)
    assert sorted(action.choices) == sorted({*RULES, "time"})
    rc = main(["simulate", str(SYNTH), "--plan", str(plan_file), "--model", "deepseek-v3", "--hardware", "h200",
               "--batch-tokens", "32", "--batches", "1", "--dispatch", "sglang-static", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["dispatch"] == "sglang-static" and out["moe_step_seconds"] > 0


def test_cli_simulate_text(plan_file, capsys):
    rc = main(["simulate", str(SYNTH), "--plan", str(plan_file), "--model", "deepseek-v3", "--hardware", "b200",
               "--phase", "prefill", "--batches", "1", "--overlap"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "B200 SXM" in out and "perfect balance" in out and "MoE time per step" in out and "65,536 tokens" in out


@pytest.mark.parametrize("extra, message", [
    (["--hardware", "a100"], "unknown hardware 'a100': choose one of h100, h200, b200, cpu"),
    (["--hardware", "h200", "--model", "gpt-5"], "unknown model 'gpt-5'"),
    (["--hardware", "h200", "--model", "deepseek-v2-lite"],
     "the placement has 58 layers x 256 experts but DeepSeek-V2-Lite has 26 MoE layers x 64 experts"),
    (["--hardware", "h200", "--whole-windows", "--batch-tokens", "4"], "give one of the two"),
])
def test_cli_simulate_bad_input(plan_file, capsys, extra, message):
    args = ["simulate", str(SYNTH), "--plan", str(plan_file)]
    if "--model" not in extra:
        args += ["--model", "deepseek-v3"]
    assert main(args + extra) == 2
    assert message in capsys.readouterr().err


def test_cli_simulate_refuses_a_plan_of_another_trace(tmp_path, capsys):
    p = eplb.plan(np.ones((3, 256)), num_gpus=8).placement
    save_placement(p, tmp_path / "small.json")
    assert main(["simulate", str(SYNTH), "--plan", str(tmp_path / "small.json"), "--model", "deepseek-v3",
                 "--hardware", "h200"]) == 2
    assert "the plan is 3 layers x 256 experts but the trace is 58 layers x 256 experts" in capsys.readouterr().err


def test_cli_simulate_profile_file(plan_file, tmp_path, capsys):
    bad = tmp_path / "gpu.yaml"
    bad.write_text("name: mine\nflops_per_s: {fp8: 1.0e+15}\nhbm_bytes_per_s: -3\n")
    assert main(["simulate", str(SYNTH), "--plan", str(plan_file), "--model", "deepseek-v3",
                 "--hardware", str(bad)]) == 2
    assert "missing field(s) nvlink_bytes_per_s, internode_bytes_per_s" in capsys.readouterr().err
    bad.write_text("base: h200\nhbm_bytes_per_s: -3\n")
    assert main(["simulate", str(SYNTH), "--plan", str(plan_file), "--model", "deepseek-v3",
                 "--hardware", str(bad)]) == 2
    assert "hbm_bytes_per_s must be a finite number > 0, got -3" in capsys.readouterr().err


def test_cli_plan_objective_time(tmp_path, capsys):
    out_path = tmp_path / "p.json"
    rc = main(["plan", str(SYNTH), "--gpus", "16", "--planner", "greedy", "--objective", "time", "--model",
               "deepseek-v3", "--hardware", "h200", "--batch-tokens", "32", "-o", str(out_path), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["info"]["objective"]["batch_tokens"] == 32
    assert out["modeled"]["dispatch"] == "time" and out["modeled"]["moe_step_seconds"] > 0
    assert json.loads(out_path.read_text())["metrics"]["objective"] == "time"
    rc = main(["plan", str(SYNTH), "--gpus", "16", "--planner", "greedy", "--model", "deepseek-v3",
               "--hardware", "h200"])
    text = capsys.readouterr().out
    assert rc == 0 and "modeled (DeepSeek-V3 on H200 SXM, decode, dispatch even" in text and "max/mean" in text


@pytest.mark.parametrize("extra, message", [
    (["--objective", "time"], "--objective time balances modeled time: give --model M and --hardware H"),
    (["--phase", "prefill"], "--phase describe the cost model: add --hardware"),
    (["--hardware", "h200"], "--hardware needs --model"),
    (["--model", "deepseek-v3"], "--model size the slots only with --slots-per-gpu auto"),
])
def test_cli_plan_cost_options_alone_are_refused(capsys, extra, message):
    assert main(["plan", str(SYNTH), "--gpus", "16", "--planner", "greedy"] + extra) == 2
    assert message in capsys.readouterr().err
