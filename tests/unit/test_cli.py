"""CLI through `eplb.cli.main([...])`: examples in help, JSON that parses, one-line errors, fast start."""

import contextlib
import io
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from eplb.cli import COMMANDS, main
from eplb.core.progress import Notice
from eplb.core.trace import Trace, default_meta
from eplb.formats import load_placement, save_trace

L, E, G = 6, 32, 4


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    rng = np.random.default_rng(11)
    counts = rng.poisson(rng.lognormal(3.0, 1.0, size=(1, L, E)), size=(4, L, E))
    trace = d / "trace.npz"
    save_trace(Trace(counts, np.arange(1, L + 1), default_meta(L + 1, E, top_k=4, num_expert_groups=4)), trace)
    bad_shape = d / "bad.npy"
    np.save(bad_shape, np.zeros(5))
    plan = d / "plan.json"
    assert main(["plan", str(trace), "--gpus", str(G), "-o", str(plan), "--quiet"]) == 0
    # `eplb backtest --json` output saved to a file: what `eplb plot backtest` reads.
    backtest = d / "backtest.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["backtest", str(trace), "--gpus", str(G), "-p", "greedy", "-p", "contiguous", "--interval", "1",
                     "--history", "1", "--no-oracle", "--dispatch", "even", "--dispatch", "resplit", "--json"]) == 0
    backtest.write_text(out.getvalue())
    series = d / "series.json"
    series.write_text(json.dumps({"series": [
        {"name": "static", "imbalance": [1.3, 1.4, 1.35, 1.3]},
        {"name": "greedy", "imbalance": [1.1, 1.05, 1.08, 1.1], "rebalance_at": [0, 2], "moves": [None, 6]},
    ]}))
    return {"trace": str(trace), "plan": str(plan), "bad_shape": str(bad_shape), "dir": d, "backtest": str(backtest),
            "series": str(series)}


def test_top_level_help_lists_commands_with_examples(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "examples:" in out
    for name in COMMANDS:
        assert name in out


@pytest.mark.parametrize("argv", [[c, "--help"] for c in COMMANDS]
                         + [["plot", k, "--help"] for k in ("heatmap", "balance", "replicas", "backtest")])
def test_every_command_help_shows_an_example(argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "example:" in out and "eplb " + argv[0] in out.split("example:")[1]


def _json_argv(f):
    d = f["dir"]
    return {
        "plan": ["plan", f["trace"], "--gpus", str(G)],
        "stats": ["stats", f["trace"], "--gpus", str(G)],
        "inspect": ["inspect", f["plan"], "--trace", f["trace"]],
        "capacity": ["capacity", "--model", "deepseek-v3", "--gpus", "32", "--gpu-memory", "h200",
                     "--context", "8192", "--concurrency", "2048"],
        "plot heatmap": ["plot", "heatmap", f["trace"], "-o", str(d / "h.png")],
        "plot balance": ["plot", "balance", f["trace"], "--gpus", str(G), "-o", str(d / "b.svg")],
        "plot replicas": ["plot", "replicas", f["plan"], "--trace", f["trace"], "-o", str(d / "r.png")],
        "plot backtest": ["plot", "backtest", f["backtest"], "-o", str(d / "bt.png")],
        "plot backtest series": ["plot", "backtest", f["series"], "-o", str(d / "bt2.svg")],
    }


@pytest.mark.parametrize("name", list(_json_argv({"trace": "", "plan": "", "dir": __import__("pathlib").Path("."),
                                                   "backtest": "", "series": ""})))
def test_json_output_parses(name, files, capsys):
    argv = _json_argv(files)[name]
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert isinstance(data, dict) and data
    if name.startswith("plot"):
        assert os.path.getsize(data["output"]) == data["bytes"] > 5_000


def test_plot_backtest_draws_what_eplb_backtest_wrote(files, capsys):
    results = json.loads(open(files["backtest"]).read())["results"]
    argv = ["plot", "backtest", files["backtest"], "--dispatch", "resplit", "-o", str(files["dir"] / "bt.pdf"),
            "--json"]
    assert main(argv) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["series"] == ["greedy", "contiguous"]
    # The plotted line is the backtest's own per-window score for that dispatch policy.
    for name, res in zip(info["series"], results):
        want = np.mean([w["imbalance"]["resplit"] for w in res["per_window"]])
        assert info["imbalance_mean"][name] == pytest.approx(want)
    assert open(info["output"], "rb").read(5) == b"%PDF-"
    # History 1, re-planned every window: 3 plans, the 2 later ones charged their copies.
    assert [p["moves"] is None for p in results[0]["per_plan"]] == [True, False, False]


def test_plan_scores_each_window_alone(files, capsys):
    """The per-window columns are the balancedness of each window of the trace under the plan."""
    from eplb import plan
    from eplb.formats import load_trace
    from eplb.stats.loads import balancedness

    assert main(["plan", files["trace"], "--gpus", str(G), "-p", "greedy", "--json"]) == 0
    wb = json.loads(capsys.readouterr().out)["window_balancedness"]
    trace = load_trace(files["trace"])
    greedy = plan(trace, num_gpus=G).placement
    assert wb["plan"] == pytest.approx([balancedness(greedy.gpu_loads(c)) for c in trace.counts_TLE])
    assert len(wb["contiguous"]) == trace.num_windows and max(wb["contiguous"]) < min(wb["plan"])
    assert main(["plan", files["trace"], "--gpus", str(G), "-p", "greedy"]) == 0
    out = capsys.readouterr().out
    assert "per window: median" in out and "balancedness of each window alone" in out


def test_quiet_prints_nothing(files, capsys):
    assert main(_json_argv(files)["plan"] + ["--quiet"]) == 0
    assert main(_json_argv(files)["capacity"] + ["--quiet"]) == 0
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def test_expert_groups_flag_keeps_its_short_old_spelling(files, tmp_path, capsys):
    # --groups stays a second spelling of --expert-groups: scripts use it.

    paths = []
    for flag in ("--expert-groups", "--groups"):
        paths.append(tmp_path / f"{flag.strip('-')}.json")
        assert main(["plan", files["trace"], "--gpus", "4", "--nodes", "2", "-p", "hierarchical", flag, "8",
                     "-o", str(paths[-1]), "-q"]) == 0
    a, b = (load_placement(p) for p in paths)
    np.testing.assert_array_equal(a.phy2log_LP, b.phy2log_LP)
    assert main(["plan", files["trace"], "--gpus", "4", "--expert-groups", "5"]) == 2
    assert "--expert-groups" in capsys.readouterr().err


def test_capacity_numbers_in_json(capsys):
    argv = ["capacity", "--model", "llama-3.1-70b", "--gpus", "8", "--gpu-memory", "h100", "--context", "100000",
            "--kv-dtype", "fp16", "--weight-dtype", "bf16", "--attention", "tp", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_bytes_per_token"] == 327_680 and data["redundant_per_gpu"] is None and data["fits"]


def test_plan_slots_auto_refuses_a_model_that_does_not_match_the_trace(files, capsys):
    argv = ["plan", files["trace"], "--gpus", str(G), "--slots-per-gpu", "auto", "--model", "deepseek-v3",
            "--gpu-memory", "h200", "--context", "4096", "--concurrency", "64", "--json"]
    assert main(argv) == 2
    assert "has 256 experts but the trace has 32" in capsys.readouterr().err


def test_plan_slots_auto_on_deepseek_shape(tmp_path, capsys):
    counts = np.random.default_rng(2).poisson(30, size=(1, 58, 256))
    path = tmp_path / "ds.npz"
    save_trace(Trace(counts, np.arange(3, 61), default_meta(61, 256)), path)
    argv = ["plan", str(path), "--gpus", "32", "--slots-per-gpu", "auto", "--model", "deepseek-v3",
            "--gpu-memory", "h200", "--context", "8192", "--concurrency", "2048", "--json",
            "--planner", "greedy"]  # the sizing is under test, not the (slower) default planner
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_slots"] == 32 * data["capacity"]["slots_per_gpu"] > 256


def _bad_inputs(f):
    return {
        "missing file": ["plan", str(f["dir"] / "nope.npz"), "--gpus", "4"],
        "wrong shape": ["plan", f["bad_shape"], "--gpus", "4"],
        "redundant does not split": ["plan", f["trace"], "--gpus", "4", "--redundant", "3"],
        "slots cannot hold experts": ["plan", f["trace"], "--gpus", "4", "--slots-per-gpu", "3"],
        # More GPUs than experts is planned now (issue 11); more slots per GPU than experts cannot be filled.
        "more slots per GPU than experts": ["plan", f["trace"], "--gpus", "4", "--slots-per-gpu", "33"],
        "bad slots text": ["plan", f["trace"], "--gpus", "4", "--slots-per-gpu", "many"],
        "stats missing file": ["stats", str(f["dir"] / "nope.npz")],
        # Were: a minutes-long hang, a silently ignored option, a traceback.
        "stats more slots per GPU than experts": ["stats", f["trace"], "--gpus", "4", "--redundant", "40000000"],
        "window without aggregate window": ["plan", f["trace"], "--gpus", "4", "--window", "2"],
        "planner setting of the wrong type": ["plan", f["trace"], "--gpus", "4", "--set", "quantile=abc"],
        # Were silently ignored: --span-cost and --bytes-per-expert only act with --previous,
        # and --span-cost only with nodes and expert groups.
        "span cost without previous": ["plan", f["trace"], "--gpus", "4", "--span-cost", "2"],
        "bytes per expert without previous": ["plan", f["trace"], "--gpus", "4", "--bytes-per-expert", "10"],
        "span cost on one node": ["plan", f["trace"], "--gpus", "4", "--previous", f["plan"], "--span-cost", "2"],
        "format without output": ["plan", f["trace"], "--gpus", "4", "--format", "sglang"],
        "capacity options without slots auto": ["plan", f["trace"], "--gpus", "4", "--model", "deepseek-v3",
                                                "--gpu-memory", "h200"],
        "inspect missing file": ["inspect", str(f["dir"] / "nope.json")],
        "capacity unknown model": ["capacity", "--model", "gpt-5", "--gpus", "8", "--gpu-memory", "80",
                                   "--context", "10"],
        "capacity bad memory": ["capacity", "--model", "deepseek-v3", "--gpus", "8", "--gpu-memory", "lots",
                                "--context", "10"],
        "capacity redundant does not split": ["capacity", "--model", "deepseek-v3", "--gpus", "24",
                                              "--gpu-memory", "h200", "--context", "10", "--redundant", "5"],
        "plot bad extension": ["plot", "heatmap", f["trace"], "-o", str(f["dir"] / "x.jpg")],
        "plot backtest not json": ["plot", "backtest", f["trace"], "-o", str(f["dir"] / "x.png")],
        "plot backtest policy not scored": ["plot", "backtest", f["backtest"], "--dispatch", "optimal",
                                            "-o", str(f["dir"] / "x.png")],
        "plot backtest a plan file": ["plot", "backtest", f["plan"], "-o", str(f["dir"] / "x.png")],
    }


@pytest.mark.parametrize("case", list(_bad_inputs({"trace": "", "plan": "", "bad_shape": "", "backtest": "",
                                                   "dir": __import__("pathlib").Path(".")})))
def test_bad_input_exits_2_with_one_line(case, files, capsys):
    argv = _bad_inputs(files)[case]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"eplb {argv[0]}: error: ") and "Traceback" not in err


def test_usage_error_exits_2(capsys):
    assert main(["plan"]) == 2  # argparse: missing TRACE and --gpus
    assert "usage:" in capsys.readouterr().err


def test_plan_does_not_import_heavy_libraries(files):
    # Nor the modules of other commands (a command line that names its command builds only its parser).
    others = [f"eplb.commands.{c}" for c in COMMANDS if c not in ("plan", "capacity", "simulate")]
    code = (
        "import sys; from eplb.cli import main\n"
        f"rc = main(['plan', {files['trace']!r}, '--gpus', '{G}', '--quiet'])\n"
        f"heavy = [m for m in ('torch', 'matplotlib', 'ortools', 'eplb.serving.policy', *{others!r})\n"
        f"         if m in sys.modules]\n"
        "print(rc, ','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0"], f"eplb plan imported {out[1:]}"


def test_the_program_freezes_its_objects_before_the_process_ends(monkeypatch, capsys):
    # main() runs this process's command line and the process ends after it: its objects are
    # frozen so that the shutdown's collections skip them. main([...]) (tests, callers) does not.
    import gc

    assert gc.get_freeze_count() == 0
    assert main(["--version"]) == 0 and gc.get_freeze_count() == 0
    monkeypatch.setattr(sys, "argv", ["eplb", "--version"])
    try:
        assert main() == 0
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    assert "eplb" in capsys.readouterr().out


def test_a_typo_of_a_command_lists_every_command(capsys):
    assert main(["plna", "x"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'plna'" in err and all(c in err for c in COMMANDS)


def test_unwritable_output_is_one_line(tmp_path, capsys):
    counts = np.random.default_rng(3).poisson(20, size=(2, 3, 16))
    path = tmp_path / "t.npz"
    save_trace(Trace(counts, np.arange(3), default_meta(3, 16)), path)
    assert main(["plan", str(path), "--gpus", "4", "-p", "greedy", "-o", str(tmp_path / "no" / "p.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No such file or directory" in err[0] and "p.json" in err[0]


def test_inspect_refuses_a_trace_of_other_layers(tmp_path, capsys):
    counts = np.random.default_rng(4).poisson(20, size=(1, 3, 16))
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    save_trace(Trace(counts, np.arange(3), default_meta(3, 16)), a)
    save_trace(Trace(counts, np.arange(3, 6), default_meta(6, 16)), b)
    plan_path = tmp_path / "p.json"
    assert main(["plan", str(a), "--gpus", "4", "-p", "greedy", "-o", str(plan_path), "-q"]) == 0
    assert main(["inspect", str(plan_path), "--trace", str(b)]) == 2
    assert "layer ids" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["plan", "synth"])
@pytest.mark.parametrize("where", ["missing folder", "a folder", "empty"])
def test_unwritable_output_is_refused_before_the_work(tmp_path, capsys, monkeypatch, command, where):
    """An ILP plan or a full synth takes minutes; a bad -o used to fail only after it (-o '' wrote nothing)."""
    import eplb.planning.front_door
    import eplb.stats.synth

    def must_not_run(*args, **kwargs):
        raise AssertionError("the work started before the output path was checked")

    monkeypatch.setattr(eplb.planning, "plan", must_not_run)
    monkeypatch.setattr(eplb.stats.synth, "generate", must_not_run)
    out = {"missing folder": str(tmp_path / "no" / "x.out"), "a folder": str(tmp_path), "empty": ""}[where]
    path = tmp_path / "t.npz"
    save_trace(Trace(np.ones((1, 2, 8), dtype=np.int64), np.arange(2), default_meta(2, 8)), path)
    argv = {"plan": ["plan", str(path), "--gpus", "2"], "synth": ["synth", "--windows", "1"]}[command]
    assert main(argv + ["-o", out]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"eplb {command}: error: ") and "-o" in err


def test_stats_idle_layer_is_balanced_in_every_column(tmp_path, capsys):
    counts = np.random.default_rng(5).poisson(20, size=(2, 3, 16))
    counts[:, 1] = 0  # a layer that saw no tokens
    path = tmp_path / "t.npz"
    save_trace(Trace(counts, np.arange(3), default_meta(3, 16)), path)
    assert main(["stats", str(path), "--gpus", "4", "--json"]) == 0
    per_layer = json.loads(capsys.readouterr().out)["per_layer"]
    for column in ("hot/mean", "contiguous max/mean", "bound/mean"):
        assert per_layer[column][1] == 1.0, column  # bound/mean was 0.0


def test_plan_refuses_a_trace_without_tokens(tmp_path, capsys):
    """An all-zero trace was 'planned' (HEURISTIC, every ratio 1.0) and written without a word."""
    path = tmp_path / "zero.npz"
    save_trace(Trace(np.zeros((2, 3, 16), dtype=np.int64), np.arange(3), default_meta(3, 16)), path)
    assert main(["plan", str(path), "--gpus", "4", "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no tokens" in err and not (tmp_path / "p.json").exists()
    counts = np.random.default_rng(6).poisson(20, size=(2, 3, 16))
    counts[-1] = 0  # traffic, but not in the newest window
    save_trace(Trace(counts, np.arange(3), default_meta(3, 16)), path)
    assert main(["plan", str(path), "--gpus", "4", "--aggregate", "last"]) == 2
    assert "--aggregate last" in capsys.readouterr().err
    assert main(["plan", str(path), "--gpus", "4", "-q"]) == 0


def test_plan_says_which_windows_it_planned_on(files, capsys):
    """--aggregate window --window 2 printed "(window of 4 windows)"; --window 9 of 4 was clipped silently."""
    assert main(["plan", files["trace"], "--gpus", str(G), "-p", "greedy", "--aggregate", "window",
                 "--window", "2"]) == 0
    assert "planning load (sum of the newest 2 of 4 windows)" in capsys.readouterr().out
    assert main(["plan", files["trace"], "--gpus", str(G), "-p", "greedy", "--aggregate", "ema"]) == 0
    assert "planning load (EMA of 4 windows, alpha 0.3)" in capsys.readouterr().out
    assert main(["plan", files["trace"], "--gpus", str(G), "--aggregate", "window", "--window", "9"]) == 2
    assert "--window 4 or less" in capsys.readouterr().err


def test_closed_pipe_is_not_an_error(tmp_path):
    """`eplb stats --json | head -1` printed "eplb stats: error: Broken pipe" and exited 2."""
    path = tmp_path / "many_layers.npz"  # > 64 KiB of JSON: the writer blocks until the reader leaves
    counts = np.random.default_rng(7).poisson(20, size=(1, 2000, 8))
    save_trace(Trace(counts, np.arange(2000), default_meta(2000, 8)), path)
    code = (
        "import sys; from eplb.cli import main\n"
        f"sys.exit(main(['stats', {str(path)!r}, '--gpus', '4', '--json']))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(1)
    proc.stdout.close()  # the reader goes away after one byte, like head -c1
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0 and err == ""


@pytest.mark.parametrize("argv, prog", [(["stats", "x.npz", "--bogus"], "eplb stats"),
                                        (["plot", "heatmap", "x.npz", "-o", "x.png", "--zzz"], "eplb plot heatmap"),
                                        (["--zzz"], "eplb")])
def test_unknown_arguments_are_reported_by_the_command_they_were_given_to(argv, prog, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"{prog}: error: unrecognized arguments: ")


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_a_slow_step_shows_one_status_line_on_a_terminal_and_erases_it():
    tty = _Tty()
    with Notice("eplb plan: robust ...", after=0.0, stream=tty):
        deadline = time.monotonic() + 5.0
        while "robust" not in tty.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
    assert tty.getvalue().startswith("\replb plan: robust ... 0s") and tty.getvalue().endswith("\r\x1b[2K")
    quick = _Tty()
    with Notice("never shown", after=60.0, stream=quick):
        pass
    assert quick.getvalue() == ""
    piped = io.StringIO()                                   # not a terminal: nothing
    with Notice("never shown", after=0.0, stream=piped):
        time.sleep(0.05)
    assert piped.getvalue() == ""
