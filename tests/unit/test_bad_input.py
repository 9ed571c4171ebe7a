"""Issue 11, one test per case: inputs that were accepted by surprise, misleading messages, and
loads that overflowed or poisoned state. Each bad input now gets one line naming the value
and the fix (CLI exit 2); the atomic-output and bounded-input cases are in test_files.py.
"""

from __future__ import annotations

import io
import json
import zipfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest

import eplb
from eplb.cli import main
from eplb.core.placement import Placement
from eplb.core.trace import MAX_COUNT, Trace, default_meta
from eplb.errors import EplbError
from eplb.formats import load_history, load_placement, load_trace, save_trace


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def refused(argv: list) -> str:
    """The one error line of a command that must exit 2."""
    rc, _, err = run_cli(argv)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"eplb {argv[0]}: error: "), (rc, err)
    return lines[0]


def trace_file(path: Path, L: int = 4, E: int = 16, T: int = 3, first: int = 1, synthetic: bool = False,
               seed: int = 0) -> Path:
    counts = np.random.default_rng(seed).poisson(30, size=(T, L, E))
    save_trace(Trace(counts, np.arange(first, first + L), default_meta(first + L, E, source="t", synthetic=synthetic)),
               path)
    return path


# Inputs that overflow or poison state ------------------------------------------------------------

def test_window_sums_that_overflow_int64_are_refused(tmp_path):
    """4 windows of 2**62 wrapped to 0 in int64 totals; stats and plan then reported garbage."""
    counts = np.full((4, 2, 8), MAX_COUNT, dtype=np.int64)
    with pytest.raises(EplbError, match=r"counts sum to .* more than 2\*\*62"):
        Trace(counts, np.arange(2), default_meta(2, 8))
    np.save(tmp_path / "big.npy", counts)
    for argv in (["stats", tmp_path / "big.npy"], ["plan", tmp_path / "big.npy", "--gpus", "4"]):
        assert "more than 2**62" in refused(argv)


def test_huge_loads_are_refused_by_plan_not_scored_as_nan():
    with pytest.raises(EplbError, match=r"loads sum to inf, more than 2\*\*62.*scale them down"):
        eplb.plan(np.full((2, 8), 1e308), num_gpus=4)
    with pytest.raises(EplbError, match="loads must be numbers, not true/false"):
        eplb.plan([[1, True, 2, 3]], num_gpus=2)
    with pytest.raises(EplbError, match="dtype complex128"):
        eplb.plan(np.ones((1, 8)) * (1 + 2j), num_gpus=2)


@pytest.mark.parametrize("bad", [np.full((2, 8), 1e308), np.full((2, 8), np.nan), -np.ones((2, 8)),
                                 np.ones((2, 8)) * (1 + 1j), np.ones((2, 8), dtype=bool), [["1"] * 8] * 2,
                                 np.ones((3, 8))])
def test_one_bad_observation_leaves_the_rebalancer_unchanged(bad):
    """One observe() of 1e308 left the window inf/NaN for good."""
    rb = eplb.Rebalancer(eplb.plan(np.arange(16.0).reshape(2, 8), num_gpus=4).placement, window=4, interval=1,
                         min_improvement=0.0)
    rb.observe(np.arange(16.0).reshape(2, 8))
    before, step = rb.load_LE, rb.step
    with pytest.raises(EplbError):
        rb.observe(bad)
    assert np.array_equal(rb.load_LE, before) and rb.step == step
    assert rb.observe(np.arange(16.0).reshape(2, 8)) in (True, False)
    assert np.isfinite(rb.rebalance().after.imbalance_L).all()


def test_a_bad_plot_series_is_one_line(tmp_path):
    """`"imbalance": [1, "a", null]` was a ValueError traceback."""
    path = tmp_path / "series.json"
    for series in ({"name": "x", "imbalance": [1, "a", None]},
                   {"name": "x", "imbalance": [1, 2], "rebalance_at": [0.5]},
                   {"name": "x", "imbalance": [1, True]},
                   {"name": "x", "imbalance": [1, 2], "moves": ["many"]}):
        path.write_text(json.dumps({"series": [series]}))
        line = refused(["plot", "backtest", path, "-o", tmp_path / "b.png"])
        assert "series 0" in line
    assert not (tmp_path / "b.png").exists()


# Wrong or surprising acceptance -------------------------------------------------------------

def test_previous_for_other_layer_ids_is_refused_like_inspect_refuses_it(tmp_path):
    """--previous with a plan for other layers was accepted (12,846 moves reported)."""
    a = trace_file(tmp_path / "a.npz", first=3)
    b = trace_file(tmp_path / "b.npz", first=0)
    old = tmp_path / "old.json"
    assert run_cli(["plan", a, "--gpus", "4", "-p", "greedy", "-o", old, "-q"])[0] == 0
    via_plan = refused(["plan", b, "--gpus", "4", "--previous", old])
    via_inspect = refused(["inspect", old, "--trace", b])
    for line in (via_plan, via_inspect):
        assert "is for MoE layer ids 3..6 but" in line and "layer ids 0..3" in line
    with pytest.raises(EplbError, match="previous placement is for MoE layer ids 3..6"):
        eplb.plan(load_trace(b), num_gpus=4, previous=load_placement(old))


def test_per_token_ids_are_not_read_as_one_expert(tmp_path):
    """[N, L, 1] (top-1 ids of N tokens) was read as counts with E = 1."""
    np.save(tmp_path / "ids.npy", np.zeros((500, 4, 1), dtype=np.int16))
    line = refused(["stats", tmp_path / "ids.npy"])
    assert "one expert per layer" in line and "Per-token expert ids" in line


def test_an_npy_export_says_what_it_assumed_and_takes_the_models_layers(tmp_path):
    """A .npy has no layer ids: an SGLang export wrote 3 rows for a 16-layer model, without a word."""
    np.save(tmp_path / "c.npy", np.random.default_rng(0).poisson(20, size=(2, 3, 8)))
    out = tmp_path / "loc.json"
    rc, _, err = run_cli(["plan", tmp_path / "c.npy", "--gpus", "4", "-f", "sglang", "-o", out])
    assert rc == 0 and "note: " in err and "records no layer ids" in err and "--layer-ids" in err
    assert len(json.loads(out.read_text())["physical_to_logical_map"]) == 3
    rc, _, err = run_cli(["plan", tmp_path / "c.npy", "--gpus", "4", "-f", "sglang", "-o", out,
                          "--layer-ids", "13-15", "--num-hidden-layers", "16"])
    assert rc == 0 and "note" not in err
    rows = json.loads(out.read_text())["physical_to_logical_map"]
    assert len(rows) == 16 and rows[0] == [p % 8 for p in range(12)]  # dense rows are SGLang's trivial map
    assert "gives 2 layer ids, but the trace has 3" in refused(["plan", tmp_path / "c.npy", "--gpus", "4",
                                                              "--layer-ids", "1,2"])
    assert "must exceed the largest MoE layer id" in refused(
        ["plan", tmp_path / "c.npy", "--gpus", "4", "-f", "sglang", "-o", out, "--layer-ids", "13-15",
         "--num-hidden-layers", "15"])
    assert "--format sglang" in refused(["plan", tmp_path / "c.npy", "--gpus", "4", "--num-hidden-layers", "16"])
    # A trace that records its layers is not relabelled.
    assert "disagrees" in refused(["plan", trace_file(tmp_path / "t.npz"), "--gpus", "4", "--layer-ids", "0-3"])


@pytest.mark.parametrize("change, message", [
    ({"version": 2}, "version 2 is not one this eplb reads"),
    ({"version": "1"}, "version '1' is not one"),
    ({"format": "other.tool"}, "format is 'other.tool', not 'eplb.placement'"),
    ({"metrics": [1, 2, 3]}, "metrics must be a JSON object"),  # not "cannot convert dictionary update sequence"
    ({"planner": ["greedy"]}, "planner must be a name"),
    ({"physical_to_logical_map": [[True, 1, 2, 3]]}, "must be numbers, not true/false"),
])
def test_placement_files_of_unknown_layout_or_types_are_refused(tmp_path, change, message):
    path = tmp_path / "p.json"
    d = Placement(np.array([[0, 1, 2, 3]]), 2, 4).to_dict()
    path.write_text(json.dumps({**d, **change}))
    with pytest.raises(EplbError, match=message):
        load_placement(path)
    assert message.split()[0] in refused(["inspect", path])


def test_json_booleans_are_not_counts(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps({"logical_count": [[5, 3, True, 0], [1, False, 2, 2]]}))
    assert "must be numbers, not true/false" in refused(["stats", path])


@pytest.mark.parametrize("argv, message", [
    (["-o", "plan.yaml"], "ends in a name for trtllm files, but --format is eplb (the default): add --format trtllm"),
    (["-f", "vllm", "-o", "x.json"], "ends in a name for eplb or sglang files, but --format is vllm"),
    (["-f", "trtllm", "-o", "x.pt"], "for vllm files"),
])
def test_output_names_that_contradict_the_format_are_refused(tmp_path, argv, message):
    t = trace_file(tmp_path / "t.npz")
    argv = [a if not a.endswith((".yaml", ".json", ".pt")) else tmp_path / a for a in argv]
    assert message in refused(["plan", t, "--gpus", "4", *argv])
    assert not any(p.suffix in (".yaml", ".json", ".pt") for p in tmp_path.iterdir())
    with pytest.raises(EplbError, match="the name ends in"):
        eplb.formats.export.write_placement(Placement(np.array([[0, 1, 2, 3]]), 2, 4), tmp_path / "x.json", "vllm")


def test_synthetic_and_real_traces_are_not_mixed_into_one_history(tmp_path):
    real = trace_file(tmp_path / "real.npz")
    fake = trace_file(tmp_path / "fake.npz", synthetic=True)
    line = refused(["plan", real, fake, "--gpus", "4"])
    assert "synthetic trace(s)" in line and "recorded trace(s)" in line
    assert load_history([real, real]).meta["synthetic"] is False


# Misleading messages -------------------------------------------------------------------------

def test_a_zip_given_as_a_placement_is_named_for_what_it_is(tmp_path):
    """Every zip was "a vLLM .pt placement export"."""
    t = trace_file(tmp_path / "t.npz")
    assert "an eplb trace (.npz), not an eplb placement file" in refused(["inspect", t])
    with zipfile.ZipFile(tmp_path / "x.zip", "w") as z:
        z.writestr("readme.txt", "hello")
    assert "a zip archive, not an eplb placement file" in refused(["inspect", tmp_path / "x.zip"])


def test_a_folder_is_a_folder_not_missing(tmp_path):
    """`eplb inspect DIR` said the folder "does not exist"."""
    line = refused(["inspect", tmp_path])
    assert "is a folder, not a file" in line and "does not exist" not in line
    assert "does not exist" in refused(["inspect", tmp_path / "nope.json"])


def test_stats_default_gpus_fit_a_small_model(tmp_path):
    """`eplb stats` on an 8-expert trace said "8 experts < 32 GPUs" without naming --gpus."""
    t = trace_file(tmp_path / "t.npz", E=8)
    rc, out, _ = run_cli(["stats", t])
    assert rc == 0 and "GPU figures for 8 GPUs (default; set --gpus)" in out
    rc, out, _ = run_cli(["stats", t, "--gpus", "32", "--json"])
    assert rc == 0 and json.loads(out)["gpus"] == 32  # more GPUs than experts: the round-robin baseline


def test_previous_from_other_gpus_names_gpus_not_slots(tmp_path):
    """--previous from a 16-GPU plan with --gpus 8 complained about slots_per_gpu (17)."""
    t = trace_file(tmp_path / "t.npz", E=256, L=2)
    old = tmp_path / "old.json"
    assert run_cli(["plan", t, "--gpus", "16", "-p", "greedy", "-o", old, "-q"])[0] == 0
    line = refused(["plan", t, "--gpus", "8", "--previous", old])
    assert "is served on 16 GPUs (17 slots each) but --gpus is 8" in line and "give --gpus 16" in line


def test_default_redundant_slots_are_what_the_help_says(tmp_path, capsys):
    """--gpus 7 got 10 redundant slots although --help said one per GPU."""
    assert main(["plan", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "ceil(E / G) + 1 slots per GPU" in help_text
    t = trace_file(tmp_path / "t.npz", E=256, L=2)
    rc, out, _ = run_cli(["plan", t, "--gpus", "7", "-p", "greedy"])
    assert rc == 0 and "266 slots (10 redundant: one per GPU plus 3 that round 256 experts up to a multiple of " \
                      "7 GPUs; 38 per GPU)" in out


# Models with few experts --------------------------------------------------------------------

def test_mixtral_on_more_gpus_than_experts(tmp_path):
    """8 experts on 16 GPUs with 32 slots was refused ("more GPUs (16) than logical experts (8)")."""
    load = np.random.default_rng(0).pareto(1.2, (4, 8)) * 100
    res = eplb.plan(load, num_gpus=16, slots_per_gpu=2)
    assert res.placement.num_slots == 32 and (res.placement.replica_count_LE >= 1).all()
    per_gpu = np.sort(res.placement.phy2log_LP.reshape(4, 16, 2), axis=2)
    assert not (np.diff(per_gpu, axis=2) == 0).any()  # never two replicas of one expert on a GPU
    assert res.after.imbalance_L.max() < res.before.imbalance_L.max()
    # Refused only when impossible, saying why.
    with pytest.raises(EplbError, match="a GPU cannot fill them without two copies of one expert"):
        eplb.plan(load, num_gpus=16, slots_per_gpu=9)
    with pytest.raises(EplbError, match="cannot hold 8 logical experts"):
        eplb.plan(load, num_gpus=3, slots_per_gpu=2)
    t = trace_file(tmp_path / "m.npz", E=8)
    assert run_cli(["plan", t, "--gpus", "16", "--slots-per-gpu", "2", "-q"])[0] == 0


def test_a_huge_expert_count_in_a_file_is_refused_before_it_is_allocated(tmp_path):
    """The fuzz suite's find: "num_logical_experts": 5e9 in a placement file made an [L, E] count of 40 GB."""
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"physical_to_logical_map": [[0, 1, 2, 3]], "num_gpus": 2,
                                "num_logical_experts": 5 * 10**9}))
    assert "num_logical_experts (5000000000) exceeds the 4 physical slots" in refused(["inspect", path])
    (tmp_path / "loc.json").write_text(json.dumps({"physical_to_logical_map": [[0, 1, 2, 2**40]]}))
    with pytest.raises(EplbError, match="exceeds the 4 physical slots"):
        eplb.formats.export.read_placement(tmp_path / "loc.json", "sglang", num_gpus=2)


def test_a_history_whose_sum_overflows_names_its_files(tmp_path):
    counts = np.full((1, 2, 8), MAX_COUNT // 16, dtype=np.int64)  # each file sums to 2**62 exactly
    for name in ("a", "b"):
        save_trace(Trace(counts, np.arange(2), default_meta(2, 8)), tmp_path / f"{name}.npz")
    with pytest.raises(EplbError, match=r"history of .*a\.npz, .*b\.npz: counts sum to"):
        load_history([tmp_path / "a.npz", tmp_path / "b.npz"])


def test_sizes_typed_for_the_cost_model_are_bounded(tmp_path):
    """`--batches 99999999` filled memory for hours; a PiB-sized expert overflowed int64 in replay."""
    trace = eplb.Trace(np.random.default_rng(0).poisson(3, size=(2, 58, 256)), np.arange(3, 61),
                       default_meta(61, 256, top_k=8, num_expert_groups=8, source="test"))
    t = save_trace(trace, tmp_path / "ds.npz")
    cost = ["--model", "deepseek-v3", "--hardware", "h200"]
    for argv in (["replay", t, "--gpus", "8", *cost, "--batches", "99999999"],
                 ["backtest", t, "--gpus", "8", *cost, "--objective", "time", "--batches", "99999999"]):
        assert "batches per window" in refused(argv) and "input limit" in refused(argv)
    plan_path = tmp_path / "plan.json"
    assert main(["plan", str(t), "--gpus", "8", "-p", "greedy", "-q", "-o", str(plan_path)]) == 0
    assert "fewer batches per window (--batches)" in refused(["simulate", t, "--plan", plan_path, *cost,
                                                               "--batches", "99999999"])
    assert "exceeds 2**62 bytes" in refused(["replay", t, "--gpus", "8", "--bytes-per-expert", str(10**23)])
