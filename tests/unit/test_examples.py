"""The examples run end to end (small settings): their printed reports are what the README shows."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


TORCH_EXAMPLES = ("collect_and_plan", "ep_moe_demo")
"""Examples that import torch at the top: their tests skip cleanly without it."""


def load_example(name):
    if name in TORCH_EXAMPLES:
        pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_serving_loop_rebalances_on_two_nodes_and_survives_a_failed_rank(capsys):
    """Seeded DeepSeek-V3-shaped loads (no trace file), 16 GPUs on 2 nodes, a rank failing halfway."""
    ex = load_example("serving_loop")
    assert ex.main(["--trace", "no-such-trace.npz", "--gpus", "16", "--redundant", "48", "--nodes", "2",
                    "--steps-per-window", "2", "--step-ms", "0", "--interval", "8", "--fail-rank", "3"]) == 0
    out = capsys.readouterr().out
    assert "seeded random loads" in out and "rank 3 failed: re-planned on 15 ranks" in out
    rebalances = [line for line in out.splitlines() if ": rebalanced (planned in" in line]
    assert rebalances and "groups span" in rebalances[0]      # node-aware report on 2 nodes
    assert "served 64 steps" in out


def test_serving_loop_reports_a_bad_option_as_an_eplb_error():
    from eplb.errors import EplbError

    ex = load_example("serving_loop")
    with pytest.raises(EplbError, match="surviving ranks"):   # __main__ prints it as one line
        ex.main(["--trace", "no-such-trace.npz", "--gpus", "8", "--redundant", "8", "--steps-per-window", "1",
                 "--step-ms", "0", "--interval", "1000", "--fail-rank", "3"])


def test_collect_and_plan_writes_a_trace_and_plans_from_it(tmp_path, capsys, torch_one_thread):
    ex = load_example("collect_and_plan")
    out_file = tmp_path / "collected.npz"
    assert ex.main(["--windows", "2", "--gpus", "8", "--out", str(out_file)]) == 0
    from eplb.formats import load_trace

    trace = load_trace(out_file)
    assert trace.num_windows == 2 and trace.counts_TLE.sum() > 0
    assert "planner greedy" in capsys.readouterr().out


@pytest.mark.parametrize("bad, msg", [
    (["--layers", "100"], "has only 58 MoE layers"),   # was an IndexError
    (["--layers", "-1"], "--layers must be >= 1"),     # silently dropped the last layer
    (["--layers", "0"], "--layers must be >= 1"),      # silently meant all layers
    (["--windows", "0"], "--windows must be >= 1"),    # said no tokens were routed
])
def test_collect_and_plan_refuses_bad_counts_before_collecting(bad, msg, tmp_path):
    from eplb.errors import EplbError

    ex = load_example("collect_and_plan")
    with pytest.raises(EplbError, match=msg):
        ex.main(["--trace", str(ROOT / "traces" / "deepseek.npz"), "--out", str(tmp_path / "c.npz"), *bad])
    assert not (tmp_path / "c.npz").exists()


def test_collect_and_plan_rebuilds_the_router_of_a_collected_trace(tmp_path, torch_one_thread):
    import torch

    from eplb.runtime.collect import RouterCollector
    from eplb.runtime.model import DeepSeekModel, ModelConfig

    cfg = ModelConfig(num_layers=2, num_logical_experts=16, num_expert_groups=4, topk_groups=3, top_k=10)
    with RouterCollector(DeepSeekModel(cfg).eval()) as rec, torch.no_grad():
        rec.model(torch.randint(0, cfg.vocab, (1, 5)))
    rebuilt = load_example("collect_and_plan").model_config(rec.trace(), None)   # raised: top_k 10 > 2 x 4
    assert (rebuilt.num_expert_groups, rebuilt.topk_groups, rebuilt.top_k) == (4, 3, 10)


def test_ep_moe_demo_refuses_non_positive_sizes_before_starting_a_process_group(capsys):
    demo = load_example("ep_moe_demo")
    for flag in ("--tokens", "--steps", "--layers", "--hidden", "--expert-hidden"):
        with pytest.raises(SystemExit) as exc:
            demo.parse([flag, "0"])
        assert exc.value.code == 2
        assert f"argument {flag}: must be >= 1, got 0" in capsys.readouterr().err
    assert demo.parse(["--tokens", "5"]).tokens == 5
