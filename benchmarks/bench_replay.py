"""Closed-loop replay of drifting traffic: the online policies side by side on four traces.

    python benchmarks/bench_replay.py                         # real data from ../shared when present
    python benchmarks/bench_replay.py --write-docs            # also write docs/results/replay.md
    python benchmarks/bench_replay.py --shared /path/to/traces --traces v2 topic

Legend: T = windows, L = MoE layers, E = logical experts, G = GPUs, P = physical slots.

Each trace is replayed in time order with `eplb.evaluate.replay.replay`: the first half of its windows is
history only (the placement served from then on is the robust plan of it), the second half is
served, decisions take effect after one window of delay. Policies (eplb.serving.policy): static (never
rebalance), window N (plan on the sum of the newest N windows with greedy at every decision,
migration-aware, move_cost 0.001: the Rebalancer's window=N rule), adaptive (the default), and
hindsight (greedy planned on the served window itself); on v2 also the static and adaptive
runs planned for re-split (`plan_for="resplit"`: the warm-up plan and the policy searched under
re-split scores, eplb.planning.resplit_repair), whose re-split column is what that engine serves.
Scores: busiest / mean GPU over every
(served window, layer), median and p95, under an even split and under per-batch re-split
(`resplit` on the window's own counts); moves are experts copied, summed over layers, per
served window (and as a share of the L x P physical slots).

Traces:
- v2: DeepSeek-V2-Lite per-token top-6 (../shared), prompts in numeric order, cut at prompt
  boundaries into windows of >= 4,096 tokens (43 windows); 8 GPUs, 72 slots.
- v3: the 8 SGLang DeepSeek-V3 workloads chained as phases (file order), 6 windows each,
  every window a seeded multinomial draw of 4,096 tokens x 8 from the workload's counts; 32 GPUs,
  288 slots.
- deepseek: traces/deepseek.npz (synthetic, 32 windows); 32 GPUs, 288 slots.
- topic: `eplb synth` with topic shifts (seed 1; 64 experts, top-2, 26 layers, 2,048 tokens a
  window, 48 windows, 6 shifts, skew 1.0, one phase); 8 GPUs, 72 slots.
Without ../shared, v2 and v3 are left out (said in the output).

Decision speed (issue 12's serving target, `--speed`, on by default): at DeepSeek-V3 shape
(58 x 256, 32 GPUs / 288 slots) the adaptive policy's decision (observe the window just served,
then decide) is timed at every served window of the v3 trace (deepseek.npz without ../shared),
side by side with SGLang's from-scratch plan (its copy of DeepSeek's EPLB, sglang==0.5.23, as
benchmarks/bench_greedy.py loads it) on the same windows' sum, interleaved so both see the same
machine load: global (one node, the replay's topology) and hierarchical (4 nodes, 8 groups,
SGLang's choice for a 4-node DeepSeek-V3). The Rebalancer's whole rebalance() (decision,
scores, safe migration schedule) is timed on the same windows too.

Static floors (issue 15, `--floors`, on by default, v2 only): even-split scores of static plans
(robust and greedy) planned on the history, on the scored windows themselves (in sample) and
across them (planned on the even-numbered scored windows, scored on the odd ones and the other
way round), on the first half of v2 (10 windows of history, 11 scored: the selection data the
policy's settings were chosen on) and on the reported split. The same under per-batch re-split
(exact, `eplb.planning.resplit_repair`): the history's robust plan, that plan searched for re-split on
the history (a past-only plan), and the search on the scored windows (in sample) and across them.

Time in the loop (issue 14, `--time`, on by default): v2 and v3 replayed again with the
policies and hindsight planning for modeled time (`objective=TimeObjective`, H200, FP8
experts, decode at 128 tokens per GPU per step) and every served window scored in modeled MoE
seconds per step over 2 drawn step batches (independent expert choices), under the even split,
the token re-split and the per-batch time dispatch, beside the token ratios.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("EPLB_JIT", "wait")  # timings of machine code (compiled at first call)

from _report import write_results  # noqa: E402  (benchmarks/_report.py)

from eplb.commands.common import format_table  # noqa: E402
from eplb.core.topology import Topology  # noqa: E402
from eplb.evaluate.replay import replay  # noqa: E402
from eplb.formats import load_trace  # noqa: E402
from eplb.stats.synth import SynthSettings, generate, topic_shift_stats  # noqa: E402

SYNTH = ROOT / "traces" / "deepseek.npz"
POLICIES = [("static", "static", {}), ("window 2", "window", {"window": 2}), ("window 8", "window", {"window": 8}),
            ("window all", "window", {"window": None}), ("adaptive", "adaptive", {})]
TOPIC = dict(num_windows=48, tokens_per_window=2048, num_hidden_layers=27, first_moe_layer=1, num_experts=64,
             top_k=2, num_expert_groups=1, topk_groups=1, topic_shifts=6, skew=1.0, phase_share=0.0, seed=1)


def v2_prompt_windows(path: Path, min_tokens: int = 4096) -> tuple[np.ndarray, str]:
    """Counts [T, 26, 64]: prompts in numeric order, a window closes once it holds >= min_tokens."""
    with np.load(path, allow_pickle=False) as z:
        keys = sorted(z.files, key=lambda k: int(re.sub(r"\D", "", k) or 0))
        prompts = [z[k] for k in keys]
    L, E = prompts[0].shape[0], 64
    windows, cur, n = [], [], 0
    for a in prompts:
        cur.append(a)
        n += a.shape[1]
        if n >= min_tokens:
            ids_LN = np.concatenate(cur, axis=1).astype(np.int64).reshape(L, -1)
            windows.append(np.bincount((np.arange(L)[:, None] * E + ids_LN).ravel(), minlength=L * E).reshape(L, E))
            cur, n = [], 0
    tokens = sum(a.shape[1] for a in prompts)
    return np.stack(windows), (f"{path.name}: {len(keys)} prompts, {tokens:,} tokens, cut at prompt boundaries "
                               f"into {len(windows)} windows of >= {min_tokens:,} tokens")


def v3_phases(folder: Path, windows_per_phase: int = 6, tokens: int = 4096, seed: int = 0) -> tuple[np.ndarray, str]:
    """Counts [8 x windows_per_phase, 58, 256]: each workload a phase of multinomial windows."""
    files = sorted(folder.glob("*.json"))
    rng = np.random.default_rng(seed)
    out = []
    for f in files:
        total_LE = load_trace(f).total().astype(np.float64)
        p_LE = total_LE / total_LE.sum(axis=1, keepdims=True)
        for _ in range(windows_per_phase):
            out.append(np.stack([rng.multinomial(tokens * 8, p) for p in p_LE]))
    names = ", ".join(f.stem for f in files)
    return np.stack(out), (f"{len(files)} SGLang workloads chained ({names}), {windows_per_phase} windows each of "
                           f"{tokens:,} tokens x 8 drawn from the workload's counts (seed {seed})")


def topic_trace() -> tuple[np.ndarray, str]:
    t = generate(SynthSettings(**TOPIC))
    st = topic_shift_stats(t)
    return t.counts_TLE, (f"eplb synth, seed {TOPIC['seed']}: {t.num_windows} windows of "
                          f"{TOPIC['tokens_per_window']:,} tokens, {len({d['window'] for d in st})} topic shifts "
                          f"turning {len(st)} (layer, expert) "
                          f"pairs hot: share of the layer's tokens before {np.median([d['before'] for d in st]):.4f}, "
                          f"after {np.median([d['after'] for d in st]):.3f} (medians)")


def load_traces(shared: Path, which: list[str]) -> list[tuple[str, np.ndarray, Topology, str]]:
    out = []
    v2 = shared / "deepseek_v2_lite_per_token" / "per_token_topk.npz"
    v3 = shared / "deepseek_v3_sglang"
    for name in which:
        if name == "v2":
            if not v2.is_file():
                print(f"# v2 left out: {v2} not found")
                continue
            counts, how = v2_prompt_windows(v2)
            out.append(("v2", counts, Topology(8, 9), how))
        elif name == "v3":
            if not (v3.is_dir() and sorted(v3.glob("*.json"))):
                print(f"# v3 left out: {v3} not found")
                continue
            counts, how = v3_phases(v3)
            out.append(("v3", counts, Topology(32, 9), how))
        elif name == "deepseek":
            out.append(("deepseek", load_trace(SYNTH).counts_TLE, Topology(32, 9), f"{SYNTH.name} (synthetic)"))
        elif name == "topic":
            counts, how = topic_trace()
            out.append(("topic", counts, Topology(8, 9), how))
    return out


def run_trace(name: str, counts: np.ndarray, topo: Topology, plan_resplit: bool = False) -> dict:
    rows = {}
    runs = [(label, policy, settings, "even") for label, policy, settings in POLICIES]
    if plan_resplit:
        runs += [("static, for re-split", "static", {}, "resplit"),
                 ("adaptive, for re-split", "adaptive", {}, "resplit")]
    for label, policy, settings, plan_for in runs:
        refs = ("static", "hindsight") if label == "adaptive" else ()
        r = replay(counts, topology=topo, policy=policy, settings=settings, references=refs, plan_for=plan_for)
        s = r.summary()
        rows[label] = {"even": s["policy"]["even"], "resplit": s["policy"]["resplit"],
                       "moves": s["moves"], "moves_per_window": s["moves_per_window"],
                       "share": s["moves_per_window_share_of_slots"], "decisions": s["decisions"],
                       "seconds": s["seconds"], "policy_seconds": s["policy_seconds"],
                       "memory_bytes": s["memory_bytes"],
                       "served": s["served_windows"]}
        if label == "adaptive":
            rows["hindsight"] = {"even": s["hindsight"]["even"], "resplit": s["hindsight"]["resplit"], "moves": None}
            assert abs(s["static"]["even"]["median"] - rows["static"]["even"]["median"]) < 1e-12
    return rows


def decision_speed(shared: Path) -> list[str]:
    """Median decision times at DeepSeek-V3 shape against SGLang's from-scratch plan (see the docstring)."""
    from bench_greedy import load_reference

    from eplb.core.placement import Placement
    from eplb.planning.front_door import plan
    from eplb.serving.policy import AdaptivePolicy
    from eplb.serving.rebalance import Rebalancer

    ref, note = load_reference()
    traces = load_traces(shared, ["v3"]) or load_traces(shared, ["deepseek"])
    name, counts, topo, _ = traces[0]
    T = counts.shape[0]
    counts = counts.astype(np.float64)
    start = Placement(plan(counts[:T // 2], topology=topo, planner="robust").solution.phy2log_LP, 32, 256)
    warm = Rebalancer(start, interval=1)            # an untimed decision: the kernels' first calls (EPLB_JIT=wait)
    warm.observe(counts[0])
    warm.rebalance()
    pol = AdaptivePolicy()
    for t in range(T // 2):
        pol.observe(counts[t], start)
    rb = Rebalancer(start, interval=1)              # every observation closes a window
    for t in range(T // 2):
        rb.policy.observe(counts[t], start)       # the same history as `pol`, given to the hook's policy
    times: dict[str, list[tuple[float, float]]] = {"decide": [], "rebalance": [], "sglang global": [],
                                                   "sglang hierarchical": []}

    def timed(key, fn):
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        times[key].append((time.perf_counter() - t0, time.process_time() - c0))
        return out

    if ref is not None:
        import torch

        torch.set_num_threads(1)        # its [58, 256] tensors are below torch's threading grain
    cur = start
    for t in range(T // 2, T):
        d = timed("decide", lambda t=t, cur=cur: (pol.observe(counts[t], cur), pol.decide(cur))[1])
        if d is not None:
            cur = Placement(d.phy2log_LP, 32, 256)
        rb.observe(counts[t])
        timed("rebalance", rb.rebalance)
        if ref is not None:
            w = torch.tensor(counts[max(0, t - 15):t + 1].sum(axis=0))
            for label, nodes, hier in (("sglang global", 1, False), ("sglang hierarchical", 4, True)):
                timed(label, lambda w=w, nodes=nodes, hier=hier: ref.rebalance_experts(w, topo.num_slots, 8, nodes,
                                                                                       topo.num_gpus, hier))
    med = {k: np.median(np.array(v) * 1e3, axis=0) for k, v in times.items() if v}
    lines = [f"decision speed on {name} ({T - T // 2} decisions, 58 x 256, 32 GPUs / 288 slots, adaptive policy "
             f"with its 16-window memory); reference: {note}"]
    rows = [[k, f"{v[0]:.1f}", f"{v[1]:.1f}", f"{min(x[0] for x in times[k]) * 1e3:.1f}"] for k, v in med.items()]
    lines.append("```\n" + format_table(["what", "median wall ms", "median CPU ms", "min wall ms"], rows) + "\n```")
    for label in ("sglang global", "sglang hierarchical"):
        if label in med:
            r, q = med["decide"] / med[label], med["rebalance"] / med[label]
            lines.append(f"- adaptive decision / {label} plan: {r[0]:.2f}x wall, {r[1]:.2f}x CPU (target <= 0.25x); "
                         f"whole rebalance() (with the migration schedule): {q[0]:.2f}x wall, {q[1]:.2f}x CPU")
    if ref is None:
        lines.append("- no SGLang reference: install it (pip install --no-deps sglang==0.5.23) for the ratios")
    return lines


def static_floors(counts: np.ndarray, topo: Topology) -> list[str]:
    """What a static plan can reach on v2 (see the module docstring): planned on the history, on
    the scored windows themselves (in sample, a bound no policy can use) and across the scored
    windows (planned on every other one, scored on the rest: the traffic's own distribution
    known, its noise not)."""
    from eplb.core.placement import Placement
    from eplb.planning.front_door import plan
    from eplb.stats.loads import imbalance

    T, L, E = counts.shape
    G = topo.num_gpus
    counts = counts.astype(np.float64)

    def planned(windows, planner):
        load = windows if planner == "robust" else windows.sum(axis=0)
        return Placement(plan(load, topology=topo, planner=planner).solution.phy2log_LP, G, E)

    def score(pl, windows):
        imb = np.concatenate([imbalance(pl.gpu_loads(w)) for w in windows])
        return f"{np.median(imb):.3f} ({np.percentile(imb, 95):.3f})"

    lines = []
    for label, hist, served in (("first half (selection data)", counts[:10], counts[10:T // 2]),
                                ("whole trace (the reported split)", counts[:T // 2], counts[T // 2:])):
        a, b = served[0::2], served[1::2]
        rows = []
        for planner in ("robust", "greedy"):
            rows.append([planner, score(planned(hist, planner), served), score(planned(served, planner), served),
                         f"{score(planned(a, planner), b)} / {score(planned(b, planner), a)}",
                         f"{score(planned(hist, planner), b)} / {score(planned(hist, planner), a)}"])
        lines.append(f"\n{label}: {len(hist)} windows of history, {len(served)} scored; even split, busiest / mean "
                     f"GPU median (p95) over (scored window, layer)")
        lines.append("```\n" + format_table(["planner", "history", "scored windows (in sample)",
                                              "even -> odd / odd -> even", "history -> odd / -> even"], rows)
                     + "\n```")
    lines.append("in sample: planned on the very windows it is scored on; even -> odd: planned on the even-numbered "
                 "scored windows, scored on the odd ones (and the other way); history -> odd / even: the history "
                 "plan on the same halves, for comparison")
    return lines


def resplit_floors(counts: np.ndarray, topo: Topology) -> list[str]:
    """What a static plan can reach on v2 when the engine re-splits every batch (see the module
    docstring): the history's robust plan, the same plan searched for re-split on the history
    (`eplb.planning.resplit_repair`, the windows alone and with their deviations widened 1.5x), and the
    search on the scored windows themselves (in sample) and across them."""
    from eplb.planning.front_door import plan
    from eplb.planning.resplit_repair import resplit_imbalance, resplit_repair

    T = counts.shape[0]
    G = topo.num_gpus
    counts = counts.astype(np.float64)

    def robust(windows):
        return plan(windows, topology=topo, planner="robust").solution.phy2log_LP

    def searched(start_LP, windows, spread):
        return resplit_repair(start_LP, windows, G, spread=spread, rounds=8)[0]

    def score(phy_LP, windows):
        imb = resplit_imbalance(phy_LP, windows, G).ravel()
        return f"{np.median(imb):.4f} ({np.percentile(imb, 95):.4f})"

    lines = []
    for label, hist, served in (("first half (selection data)", counts[:10], counts[10:T // 2]),
                                ("whole trace (the reported split)", counts[:T // 2], counts[T // 2:])):
        a, b = served[0::2], served[1::2]
        rob = robust(hist)
        rows = [["robust of the history", score(rob, served), "-"]]
        for spread in ((1.0,), (1.0, 1.5)):
            t0 = time.perf_counter()
            phy = searched(rob, hist, spread)
            rows.append([f"history plan searched, spread {spread[-1]}", score(phy, served),
                         f"{int((phy != rob).sum()):,} slots, {time.perf_counter() - t0:.0f} s"])
        rows.append(["searched on the scored windows (in sample)",
                     score(searched(robust(served), served, (1.0,)), served), "-"])
        rows.append(["searched on even -> odd / odd -> even",
                     f"{score(searched(robust(a), a, (1.0,)), b)} / {score(searched(robust(b), b, (1.0,)), a)}", "-"])
        lines.append(f"\n{label}: {len(hist)} windows of history, {len(served)} scored; per-batch re-split (exact: "
                     f"the best split of each window), busiest / mean GPU median (p95) over (scored window, layer)")
        lines.append("```\n" + format_table(["plan", "re-split median (p95)", "changed / search time"], rows) + "\n```")
    lines.append("searched: eplb.planning.resplit_repair from the robust plan (slot swaps and rewritten spare "
                 "replicas, no move price, 8 passes) under re-split scores; spread 1.5: the windows and their "
                 "deviations from the mean widened 1.5x; in sample / even -> odd: searched from the robust plan of "
                 "those windows")
    return lines


def time_in_the_loop(shared: Path) -> list[str]:
    """Replays planned for and scored in modeled step time (see the module docstring)."""
    from eplb.dispatch.cost import TimeObjective, cost_model
    from eplb.evaluate.replay import Scoring

    lines = []
    models = {"v2": "deepseek-v2-lite", "v3": "deepseek-v3"}
    for name, counts, topo, _ in load_traces(shared, ["v2", "v3"]):
        obj = TimeObjective(cost_model(models[name], "h200"), phase="decode")
        scoring = Scoring(time=obj, batches_per_window=2)
        body = []
        for label, policy, objective in (("static", "static", obj), ("adaptive", "adaptive", obj),
                                         ("adaptive, tokens", "adaptive", "tokens")):
            hind = policy == "adaptive" and objective != "tokens"
            r = replay(counts, topology=topo, policy=policy, objective=objective, scoring=scoring,
                       references=("hindsight",) if hind else ())
            s = r.summary()
            runs = [(label, s["policy"])] + ([("hindsight", s["hindsight"])] if hind else [])
            rules = ("even", "resplit", "time")
            for run_label, run in runs:
                body.append([run_label] + [f"{run[rule]['median']:.3f}" for rule in rules]
                            + [f"{1e3 * run[rule]['step_seconds']['median']:.3f}" for rule in rules]
                            + ([f"{s['moves_per_window']:,.0f}"] if run_label.startswith("adaptive") else ["-"]))
        t = s["time"]
        lines.append(f"\n{name}: {t['model']} on {t['hardware']}, {t['phase']}, {t['batch_tokens']:,} tokens per step; "
                     f"{t['how']}")
        lines.append("```\n" + format_table(["run", "even x", "re-split x", "time x", "even ms", "re-split ms",
                                              "time ms", "moves / window"], body) + "\n```")
    if not lines:
        lines.append("- left out: needs ../shared (v2, v3)")
    lines.append("x: busiest / mean GPU in tokens, median over (served window, layer); ms: modeled MoE time per step, "
                 "median over served windows (each the mean of its batches); every run but 'adaptive, tokens' "
                 "(the default policy planning on tokens, from the robust token plan) planned for time")
    return lines


def table(rows: dict) -> str:
    body = []
    for label, r in rows.items():
        mv = "-" if r["moves"] is None else f"{r['moves_per_window']:,.0f} ({100 * r['share']:.1f}%)"
        body.append([label, f"{r['even']['median']:.3f} ({r['even']['p95']:.3f})",
                     f"{r['resplit']['median']:.3f} ({r['resplit']['p95']:.3f})", mv,
                     "-" if r["moves"] is None else f"{r['moves']:,}",
                     "-" if r["moves"] is None else r["decisions"],
                     "-" if r["moves"] is None else f"{r['seconds']:.1f}",
                     "-" if r["moves"] is None else f"{r['policy_seconds']:.1f}"])
    return format_table(["policy", "even median (p95)", "re-split median (p95)", "moves / window (of slots)",
                         "moves total", "decisions", "replay s", "policy s"], body)


def targets(results: dict) -> list[str]:
    """The issue's targets, each with its measured figure."""
    lines = []
    fixed = ("window 2", "window 8", "window all")
    if "v2" in results:
        a = results["v2"]["adaptive"]
        lines.append(f"v2 even: median {a['even']['median']:.3f} (target <= 1.09), p95 {a['even']['p95']:.3f} "
                     f"(<= 1.22); re-split: median {a['resplit']['median']:.3f} (<= 1.02), p95 "
                     f"{a['resplit']['p95']:.3f} (<= 1.12)")
    if "adaptive, for re-split" in results.get("v2", {}):
        a, st = results["v2"]["adaptive, for re-split"], results["v2"]["static, for re-split"]
        lines.append(f"v2 planned for re-split (warm-up plan and policy, --plan-for resplit): re-split median "
                     f"{a['resplit']['median']:.3f} (<= 1.02), p95 {a['resplit']['p95']:.3f} (<= 1.12); moves "
                     f"{100 * a['share']:.2f}% of the slots per window; vs its static plan: re-split "
                     f"{100 * (a['resplit']['median'] / st['resplit']['median'] - 1):+.2f}%")
    if "topic" in results:
        r = results["topic"]
        best = min(fixed, key=lambda k: r[k]["even"]["median"])
        ratio = r["adaptive"]["even"]["median"] / r[best]["even"]["median"]
        lines.append(f"topic even median: adaptive {r['adaptive']['even']['median']:.3f} vs best fixed window "
                     f"({best}) {r[best]['even']['median']:.3f}: {100 * (ratio - 1):+.1f}% (target within +5%)")
    for metric in ("even", "resplit"):
        avg = {p: np.mean([results[t][p][metric]["median"] for t in results]) for p in (*fixed, "adaptive")}
        lines.append(f"{metric} median averaged over {len(results)} traces: "
                     + ", ".join(f"{p} {v:.4f}" for p, v in avg.items())
                     + f" (target: adaptive below every fixed window: {all(avg['adaptive'] < avg[p] for p in fixed)})")
    for t, r in results.items():
        a, s = r["adaptive"], r["static"]
        worse = {m: a[m]["median"] / s[m]["median"] - 1 for m in ("even", "resplit")}
        lines.append(f"{t}: moves {a['moves_per_window']:,.1f} per window = {100 * a['share']:.2f}% of the slots "
                     f"(target <= 5%), {a['moves']:,} in total; vs static: even {100 * worse['even']:+.2f}%, "
                     f"re-split {100 * worse['resplit']:+.2f}% (target <= +1%)")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shared", type=Path, default=ROOT.parent / "shared" / "traces",
                    help="folder with the real traces (default ../shared/traces)")
    ap.add_argument("--traces", nargs="+", default=["v2", "v3", "deepseek", "topic"],
                    choices=["v2", "v3", "deepseek", "topic"])
    ap.add_argument("--write-docs", action="store_true", help="write docs/results/replay.md")
    ap.add_argument("--no-speed", dest="speed", action="store_false",
                    help="skip the decision-speed part (DeepSeek-V3 shape against SGLang's plan)")
    ap.add_argument("--no-floors", dest="floors", action="store_false",
                    help="skip the static floors on v2 (plans from the history, the scored windows, across them)")
    ap.add_argument("--no-resplit-plan", dest="resplit_plan", action="store_false",
                    help="skip v2's replays planned for re-split (--plan-for resplit: minutes on 2 cores)")
    ap.add_argument("--no-time", dest="time", action="store_false",
                    help="skip the time-in-the-loop part (replays planned for and scored in modeled step time)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    results, text = {}, []

    def say(line: str = "") -> None:
        print(line, flush=True)
        text.append(line)

    say(f"# cores: {os.cpu_count()}; scores: busiest / mean GPU over every (served window, layer); first half "
        f"history, second half served, delay 1 window")
    for name, counts, topo, how in load_traces(args.shared, args.traces):
        T, L, E = counts.shape
        say(f"\n## {name}: {how}")
        say(f"{T} windows x {L} layers x {E} experts; {topo.num_gpus} GPUs, {topo.num_slots} slots "
            f"({L * topo.num_slots:,} over all layers); {T - T // 2} served")
        results[name] = run_trace(name, counts, topo, plan_resplit=args.resplit_plan and name == "v2")
        say("```\n" + table(results[name]) + "\n```")
    if results:
        say("\n## Targets (issue 15)")
        for line in targets(results):
            say(f"- {line}")
    if args.floors:
        for _, counts, topo, _ in load_traces(args.shared, ["v2"]):
            say("\n## What a static plan can reach on v2 (issue 15: floors)")
            for line in static_floors(counts, topo):
                say(line)
            say("\n## What a static plan can reach on v2 under re-split (issue 15: floors)")
            for line in resplit_floors(counts, topo):
                say(line)
    if args.time:
        say("\n## Time in the loop (issue 14: replays planned for and scored in modeled step time)")
        for line in time_in_the_loop(args.shared):
            say(line)
    if args.speed:
        say("\n## Decision speed (issue 12: the serving loop's rebalance decision)")
        for line in decision_speed(args.shared):
            say(line)
    say("\nreplay s: wall time of one replay (the adaptive row includes scoring the static and hindsight "
        "references); policy s: time the policy spent observing and deciding")
    say(f"\nbenchmark wall time {time.perf_counter() - t0:.0f} s")
    if args.write_docs:
        head = ("# Replay of drifting traffic (benchmarks/bench_replay.py)\n\n"
                "Written by `python benchmarks/bench_replay.py --write-docs` on a 2-core machine shared with "
                "other jobs (seconds are upper bounds). See docs/replay.md for what the policies do.\n\n")
        out = write_results("replay", head + "\n".join(text) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
