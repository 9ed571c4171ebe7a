"""Fuzz the command line: `main(argv)` exits 0, or 2 with one line naming the problem.

Command lines are built from the parsers themselves (every command and plot kind, every option,
in any combination), with values drawn from pools of the tricky kind: numbers that are 0,
negative, fractional, huge or not numbers; choices that do not exist; paths that are valid
traces and plans, damaged files, deeply nested JSON, a folder, a missing file, and output
files that already hold data. After every run: no traceback and no warning; on failure the
output files are byte-for-byte what they were; inputs never change; no temporary file is left;
with --json, stdout is JSON.

`eplb calibrate` measures the runtime shim on several spawned torch processes (seconds to
minutes a run): here its measurement is replaced by recorded measurements (the cost model's
times of a known profile), so its options, the fit and the profile it writes are fuzzed; the
real measurement runs in tests/distributed/test_calibrate.py.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import tempfile
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from eplb.cli import build_parser, main
from eplb.core.hardware import Hardware
from eplb.core.outputs import TEMP_SUFFIX
from eplb.core.trace import Trace, default_meta
from eplb.dispatch.calibration import CostModel, ShimMeasurements
from eplb.formats import save_placement, save_trace
from eplb.formats.export import write_placement
from eplb.planning.front_door import plan
from tests.fuzz.common import examples


def _build_pool(d: Path) -> tuple[dict[str, Path], dict[str, Path]]:
    rng = np.random.default_rng(5)
    counts = rng.poisson(rng.lognormal(2.5, 1.0, size=(1, 3, 16)), size=(4, 3, 16))
    trace = Trace(counts, np.arange(1, 4), default_meta(4, 16, top_k=2, num_expert_groups=4, source="fuzz"))
    inputs = {"trace": save_trace(trace, d / "trace.npz")}
    np.save(d / "counts.npy", counts[:, :, :8])
    inputs["npy"] = d / "counts.npy"
    (d / "sglang.json").write_text(json.dumps({"logical_count": counts.sum(0).tolist()}))
    inputs["sglang"] = d / "sglang.json"
    pl = plan(trace, num_gpus=4).placement
    inputs["plan"] = save_placement(pl, d / "plan.json")
    inputs["plan_yaml"] = write_placement(pl, d / "plan_lb.yaml", "trtllm")
    out = io.StringIO()
    with redirect_stdout(out):
        main(["backtest", str(inputs["trace"]), "--gpus", "4", "--no-oracle", "--json"])
    (d / "bt.json").write_text(out.getvalue())
    inputs["backtest"] = d / "bt.json"
    inputs["replay"] = d / "replay.npz"
    with redirect_stdout(io.StringIO()):
        main(["replay", str(inputs["trace"]), "--gpus", "4", "-q", "-o", str(inputs["replay"])])
    # DeepSeek-V3's shape (58 MoE layers x 256 experts), for the cost model's model preset.
    ds = Trace(rng.poisson(rng.lognormal(1.0, 1.0, size=(1, 58, 256)), size=(2, 58, 256)), np.arange(3, 61),
               default_meta(61, 256, top_k=8, num_expert_groups=8, source="fuzz"))
    inputs["ds_trace"] = save_trace(ds, d / "ds.npz")
    inputs["ds_plan"] = save_placement(plan(ds, num_gpus=8).placement, d / "ds_plan.json")
    hw = Hardware("fuzz GPU", {"fp8": 1e15, "bf16": 5e14, "fp32": 1e14}, hbm_bytes_per_s=3e12,
                  nvlink_bytes_per_s=4e11, internode_bytes_per_s=5e10)
    hw.save(d / "gpu.json")
    inputs["hardware"] = d / "gpu.json"
    raw = inputs["trace"].read_bytes()
    (d / "corrupt.npz").write_bytes(raw[: len(raw) // 2])
    inputs["corrupt"] = d / "corrupt.npz"
    (d / "deep.json").write_text("[" * 5000 + "]" * 5000)
    inputs["deep"] = d / "deep.json"
    (d / "empty").write_bytes(b"")
    inputs["empty"] = d / "empty"
    (d / "folder").mkdir()
    inputs["folder"] = d / "folder"
    outputs = {ext: d / f"out.{ext}" for ext in ("json", "png", "npz", "yaml", "pt", "svg")}
    return inputs, outputs


POOL_DIR = Path(tempfile.mkdtemp(prefix="eplb-fuzz-cli-"))
INPUTS, OUTPUTS = _build_pool(POOL_DIR)
PATHS = [str(p) for p in (*INPUTS.values(), *OUTPUTS.values())] + [str(POOL_DIR / "missing.npz")]
PREVIOUS = b"previous output"


@pytest.fixture(scope="module", autouse=True)
def _remove_pool():
    yield
    shutil.rmtree(POOL_DIR, ignore_errors=True)


def _parsers() -> dict[str, argparse.ArgumentParser]:
    def subcommands(p):
        return next((a.choices for a in p._actions if isinstance(a, argparse._SubParsersAction)), None)

    out = {}
    for name, p in subcommands(build_parser()).items():
        kinds = subcommands(p)
        for kind, kp in (kinds or {None: p}).items():
            out[name if kind is None else f"{name} {kind}"] = kp
    return out


PARSERS = _parsers()
PATH_DESTS = {"traces", "placement", "trace", "result", "output", "previous", "compare", "plan", "hardware"}
NUMBERS = ["0", "1", "2", "3", "4", "8", "16", "-1", "2.5", "1e3", "abc", "", "99999999999999999999", "nan", "inf"]
SMALL = ["0", "1", "2", "-1", "abc", "3.5", "99999999999"]  # synth sizes: a typo, not a minute of work
T, P, O = (lambda k: str(INPUTS[k])), (lambda k: str(INPUTS[k])), (lambda e: str(OUTPUTS[e]))
GOOD = {  # values that make a run get past argparse (drawn 6 times as often as the others)
    "traces": [T("trace")] * 3 + [T("npy"), T("sglang")], "trace": [T("trace")],
    "compare": [T("trace"), T("sglang")],
    "placement": [P("plan")], "previous": [P("plan")], "result": [T("backtest")],
    "gpus": ["4", "2", "8", "16"], "nodes": ["1", "2"], "redundant": ["4", "0", "12"],
    "slots_per_gpu": ["5", "6", "auto"], "expert_groups": ["4", "2"], "interval": ["1", "2"], "history": ["2"],
    "window": ["2"], "alpha": ["0.5"], "max_moves": ["3", "0"], "max_moves_per_gpu": ["1"], "move_cost": ["0.1"],
    "span_cost": ["1"], "bytes_per_expert": ["1000"], "layer": ["0", "2"], "context": ["4096"],
    "concurrency": ["64"], "memory_utilization": ["0.9"], "num_hidden_layers": ["4", "9"],
    "set": ["time_limit=0.2", "quantile=0.9", "refine_rounds=2", "blend=0.5"],
    "model": ["deepseek-v3", "qwen3-235b-a22b"], "gpu_memory": ["h200", "80GiB"], "layer_ids": ["1-3", "2,4,6"],
    "plan": [P("ds_plan")], "hardware": ["h200", "cpu", T("hardware")], "batch_tokens": ["32", "256"],
    "warmup": ["2", "1"], "tokens_per_window": ["16"], "delay": ["1", "0", "2"], "batches": ["2"],
    "ranks": ["2", "4"], "experts": ["8", "16"], "layers": ["1", "2"], "hidden": ["32"], "expert_hidden": ["48"],
    "top_k": ["2"], "tokens": ["1,6", "2,4,8"], "steps": ["2"], "rule": ["even", "resplit"],
}
FOR_COMMAND = {  # what a command needs of a dest that another command fills differently
    "simulate": {"traces": [T("ds_trace")], "plan": [P("ds_plan")] * 3,
                 "hardware": ["h200", "h100", T("hardware")] * 2},
    "replay": {"trace": [T("trace")] * 3 + [T("ds_trace")], "set": ["move_cost=0.5", "window=all"]},
    "plot replay": {"result": [T("replay")]},
}
NEEDED = {"capacity": {"model", "gpu_memory", "context"}, "plot balance": {"gpus"}, "simulate": {"hardware"}}
"""Options that are optional to argparse but that a run of the command needs."""
OUTPUT = {"plan": [O("json")], "synth": [O("npz")], "backtest": [O("json")], "plot": [O("png"), O("svg")],
          "replay": [O("npz")], "calibrate": [O("json")]}
BAD = {
    "set": ["bogus=1", "x", "quiet=true", "quantile=2"], "model": ["gpt-5", ""],
    "gpu_memory": ["abc", "0", "-5GB", "1e30GB"], "layer_ids": ["3..1", "a", "1-", "0-99"],
}


def _value(action: argparse.Action, command: str) -> st.SearchStrategy[str]:
    if action.dest == "output":
        return st.sampled_from(OUTPUT[command.split()[0]] * 6 + PATHS)
    good = FOR_COMMAND.get(command, {}).get(action.dest) or GOOD.get(action.dest, ["1", "2"])
    if action.dest in PATH_DESTS:
        return st.sampled_from(good * 6 + PATHS)
    if action.choices:
        return st.sampled_from([*map(str, action.choices), "bogus"])
    if command == "synth" and action.dest in ("windows", "tokens", "keep_tokens"):
        return st.sampled_from(["2", "1", "16"] * 2 + SMALL)
    return st.sampled_from(good * 6 + BAD.get(action.dest, NUMBERS))


@st.composite
def command_lines(draw, command: str) -> list[str]:
    p = PARSERS[command]
    argv = command.split()
    if command == "synth":
        argv += ["--windows", "2", "--tokens", "32"]  # defaults would generate for a minute
    for a in (a for a in p._actions if not a.option_strings):
        n = 1 if a.nargs is None else draw(st.sampled_from([1, 1, 1, 2] + ([0] if a.nargs == "*" else [])))
        argv += [draw(_value(a, command)) for _ in range(n)]
    options = [a for a in p._actions if a.option_strings and a.dest != "help"]
    # Required options (and those a command needs in practice) are given, but dropped 1 time in 20.
    needed = NEEDED.get(command, set())
    required = [a for a in options if (a.required or a.dest in needed) and draw(st.integers(0, 19))]
    chosen = draw(st.lists(st.sampled_from(options), max_size=3, unique_by=lambda a: a.dest))
    for a in required + [a for a in chosen if a not in required]:
        flag = draw(st.sampled_from(a.option_strings))
        if a.nargs == 0:
            argv.append(flag)
        else:
            for _ in range(draw(st.integers(1, 2)) if isinstance(a, argparse._AppendAction) else 1):
                argv += [flag, draw(_value(a, command))]
    if any(v == "ilp" for v in argv):
        argv += ["--set", "time_limit=0.2"]  # the solver's default is 12 s per layer
    if draw(st.integers(0, 19)) == 0:
        argv.append(draw(st.sampled_from(["--bogus", "extra", "-"])))
    return argv


def check_command_line(argv: list[str]) -> None:
    for p in OUTPUTS.values():
        p.write_bytes(PREVIOUS)
    # Files named after -o may be replaced by a run that succeeds; every other file never.
    targets = {Path(v).resolve() for flag, v in zip(argv, argv[1:]) if flag in ("-o", "--output")}
    before = {p: p.read_bytes() for p in POOL_DIR.iterdir() if p.is_file()}
    out, err = io.StringIO(), io.StringIO()
    with warnings.catch_warnings(record=True) as caught, redirect_stdout(out), redirect_stderr(err):
        warnings.simplefilter("always")
        rc = main(argv)
    err = err.getvalue()
    assert rc in (0, 2), f"exit {rc}: {err}"
    assert "Traceback" not in err, err
    assert not [w for w in caught if issubclass(w.category, (RuntimeWarning, UserWarning))], \
        [str(w.message) for w in caught]
    if rc == 2:
        lines = err.strip().splitlines()
        assert lines and lines[-1].startswith(f"eplb {argv[0]}") and ": error: " in lines[-1], err
        if not any(line.startswith("usage:") for line in lines):  # argparse prints its usage line first
            assert len(lines) == 1, err
        event("refused (exit 2)")
    else:
        if "--json" in argv and "--help" not in argv and "-h" not in argv:
            json.loads(out.getvalue())
        event("ok (exit 0)")
    after = {p: p.read_bytes() for p in POOL_DIR.iterdir() if p.is_file()}
    assert not [p for p in after if p.name.endswith(TEMP_SUFFIX)], "a temporary file was left"
    changed = sorted(str(p) for p in before if after.get(p) != before[p])
    allowed = [] if rc else [str(p) for p in before if p.resolve() in targets]
    assert set(changed) <= set(allowed), f"exit {rc} changed {changed} (may change: {allowed})"
    for p in changed:  # restore what a successful run replaced, for the next example
        p = Path(p)
        p.write_bytes(before[p])
    for p in set(after) - set(before):
        p.unlink()


def _recorded_measurements(*args, **kwargs) -> ShimMeasurements:
    """What `eplb.runtime.calibrate.measure` returns, without spawning ranks: 8 cases of rows per
    slot at 4 batch sizes, timed by the cost model of a known profile (plus 2% noise)."""
    rng = np.random.default_rng(0)
    C, B, L, G, S = 8, 2, 1, 2, 5
    tokens = np.resize([1, 4, 16, 64], C)
    rows = np.stack([rng.poisson(t * 2 / S, (B, L, G, S)) for t in tokens]).astype(float)
    shape = dict(hidden=32, expert_hidden=48, num_logical_experts=8, top_k=2)
    empty = ShimMeasurements(tuple(f"case {i}" for i in range(C)), tokens, rows, *[np.zeros((C, B, L, G))] * 3,
                             rows.sum(axis=4), **shape)
    hw = Hardware("truth", {"fp32": 2e10}, hbm_bytes_per_s=5e9, nvlink_bytes_per_s=2e8, internode_bytes_per_s=2e8,
                  expert_overhead_s=5e-5, a2a_latency_s=1e-4)
    cost = CostModel(empty.model(), hw, expert_dtype="fp32", dispatch_dtype="fp32", combine_dtype="fp32")
    compute = cost.replica_seconds(rows).sum(axis=4) * (1 + 0.02 * rng.standard_normal((C, B, L, G)))
    a2a = 2 * hw.a2a_latency_s + empty.received_CBLG * empty.row_bytes_moved / hw.nvlink_bytes_per_s
    return ShimMeasurements(empty.names, tokens, rows, compute, a2a, empty.received_CBLG, empty.received_CBLG,
                            **shape)


COUNTS = {"plan": 40, "stats": 15, "inspect": 15, "capacity": 20, "synth": 12, "backtest": 15,
          "plot heatmap": 6, "plot balance": 8, "plot replicas": 6, "plot backtest": 6, "plot replay": 10,
          "replay": 10, "simulate": 10, "calibrate": 10}


def _command_test(command: str):
    @settings(max_examples=examples(COUNTS.get(command, 10)))
    @given(argv=command_lines(command))
    def test(argv):
        if command == "calibrate":
            pytest.importorskip("torch")  # eplb.runtime imports it
            with mock.patch("eplb.runtime.calibrate.measure", _recorded_measurements):
                check_command_line(argv)
        else:
            check_command_line(argv)

    test.__name__ = test.__qualname__ = f"test_{command.replace(' ', '_')}_command_lines"
    return test


# One test per command (and plot kind), so each has its own example count and statistics.
for _command in PARSERS:
    globals()[f"test_{_command.replace(' ', '_')}_command_lines"] = _command_test(_command)
