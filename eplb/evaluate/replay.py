"""Closed-loop replay: a trace served window by window, as a serving engine sees it.

Legend: T = served windows, L = MoE layers, E = logical experts, G = GPUs, P = physical slots,
R = dispatch rules scored, N = tokens, K = top-k.

    result = replay(trace, topology=Topology.for_experts(64, num_gpus=8, slots_per_gpu=9))
    result.summary()["policy"]["even"]["median"]        # busiest / mean GPU, over (window, layer)

The loop, for a trace cut into windows (per-token traces: K tokens each, in time order):
1. The first `warmup` windows are history only: the placement served from window `warmup` on
   is the `robust` plan of them (also the *static* reference, which is never changed), and the
   policy observes them.
2. Each later window t is served by the placement in force and scored under every dispatch
   rule of `Scoring.rules` (bound once per placement; per-batch rules such as `resplit` see the
   window's own counts, which an engine knows before it dispatches the batch).
3. Then the policy observes window t (with the placement that served it) and, when no migration
   is in flight, may decide a new placement. Its moves are scheduled safely
   (`eplb.migration.schedule`), counted (moves, rounds, bytes) and take effect `delay` windows
   later: with delay 1 the window after the decision is still served by the old placement.
The policy therefore only ever knows windows before the one being served.

References, scored the same way on the same windows: *static* (the warm-up plan, kept) and
*hindsight* (a `greedy` plan made on the served window itself: what knowing the future would
allow). Each figure names its rule; `Scoring` is the one value that says how windows are scored.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from eplb import stats
from eplb.core.placement import Placement
from eplb.core.topology import Topology
from eplb.core.trace import Trace
from eplb.dispatch.cost import TimeObjective, check_objective
from eplb.dispatch.rules import get_rule
from eplb.dispatch.timed import TimeDispatch
from eplb.errors import EplbError, is_whole, name_tuple, positive_integer, seed_value, shown, whole_number
from eplb.evaluate.replay_result import ReplayResult, RunScores
from eplb.evaluate.simulate import check_batches, time_window, window_batches
from eplb.migration import Budget, count_moves, schedule
from eplb.planning.front_door import as_history, plan, size_topology
from eplb.planning.resplit_repair import PLAN_ROUNDS, resplit_repair
from eplb.serving.policy import Policy, get_policy, takes_budget

REFERENCES = ("static", "hindsight")
"""Reference runs scored beside the policy."""


@dataclass(frozen=True)
class Scoring:
    """How served windows are scored: dispatch rules, and optionally modeled step time.

    rules: dispatch rules by name or object (eplb.dispatch.get_rule; "time" is the per-batch
      time dispatch, which needs `time`), each scored separately in tokens (busiest / mean GPU).
    time: an eplb.dispatch.cost.TimeObjective (cost model, batch, phase): each window is also cut into
      `batches_per_window` step batches of its batch tokens (runs of the window's own tokens for
      per-token traces, else seeded draws from the window's counts: independent expert choices)
      and every rule is scored in modeled MoE seconds per step (eplb.dispatch.cost.step_cost); the per-batch
      time dispatch (eplb.dispatch.timed.TimeDispatch) is added to the rules when not given.
    seed: of the drawn batches (window t draws from seed and t, so every run sees the same batches).
    """

    rules: tuple = ("even", "resplit")
    time: TimeObjective | None = None
    batches_per_window: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        rules = name_tuple("Scoring rules", self.rules)
        if not rules:
            raise EplbError("Scoring needs at least one dispatch rule (e.g. rules=('even', 'resplit'))")
        if self.time is not None and not isinstance(self.time, TimeObjective):
            raise EplbError(f"Scoring.time must be an eplb.dispatch.cost.TimeObjective (cost model, batch, phase), got "
                            f"{type(self.time).__name__}")
        if self.time is None and "time" in rules:
            raise EplbError("dispatch rule 'time' splits batches for modeled time: give Scoring(time="
                            "TimeObjective(...)) (CLI: --model M --hardware H)")
        bound = tuple(TimeDispatch(self.time.cost) if r == "time" else get_rule(r) for r in rules)
        if self.time is not None and "time" not in [r.name for r in bound]:
            bound = (*bound, TimeDispatch(self.time.cost))
        names = [r.name for r in bound]
        if len(set(names)) != len(names):
            raise EplbError(f"dispatch rules {names} repeat a name: give each rule once")
        object.__setattr__(self, "rules", bound)
        object.__setattr__(self, "batches_per_window", whole_number("batches per window", self.batches_per_window, 1))
        object.__setattr__(self, "seed", seed_value("seed", self.seed))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.rules)

    @property
    def weights_index(self) -> int:
        """The rule whose shares `weights_TLP` holds: time when scored, else the first per-batch rule."""
        names = self.names
        if self.time is not None:
            return names.index("time")
        return next((i for i, r in enumerate(self.rules) if r.per_batch), 0)


# Windows ---------------------------------------------------------------------------------------

def cut_windows(trace, tokens_per_window: int | None = None) -> tuple[np.ndarray, str]:
    """Counts [T, L, E] to replay, and a line saying how they were cut.

    trace: a Trace or counts [T, L, E]. With tokens_per_window, a trace's per-token expert
    choices (topk_ids) are cut into consecutive windows of that many tokens, in time order (the
    remainder is dropped); without it, the trace's own windows (steps of a per-step dump) are used.
    """
    if tokens_per_window is None:
        counts, _, _ = as_history(trace)
        if (counts != np.round(counts)).any():
            raise EplbError("counts must be whole token counts to replay, got fractional values")
        return counts.astype(np.int64), f"{counts.shape[0]} windows as given"
    K = whole_number("tokens per window", tokens_per_window, 1)
    if not isinstance(trace, Trace) or trace.topk_ids_NLK is None:
        raise EplbError("--tokens-per-window needs a trace with per-token expert choices (topk_ids); this one "
                        "holds counts per window only: drop --tokens-per-window to replay its windows as they are")
    ids_NLK = trace.topk_ids_NLK.astype(np.int64)
    N, L, _ = ids_NLK.shape
    if K > N:
        raise EplbError(f"{K} tokens per window exceed the trace's {N} tokens: use at most {N} "
                        f"(or fewer, to get several windows)")
    T, E = N // K, trace.num_logical_experts
    ids = ids_NLK[:T * K].reshape(T, K, L, -1)
    flat = (np.arange(T)[:, None, None, None] * (L * E) + np.arange(L)[None, None, :, None] * E + ids).ravel()
    counts = np.bincount(flat, minlength=T * L * E).reshape(T, L, E)
    return counts, f"{N:,} tokens cut into {T} windows of {K} ({N - T * K} left over)"


# Replay ----------------------------------------------------------------------------------------

class _Scorer:
    """One placement bound to every rule (tables built once per placement)."""

    def __init__(self, placement: Placement, scoring: Scoring):
        self.placement = placement
        self.bound = [r.bind(placement) for r in scoring.rules]
        self.names = scoring.names
        self.time = scoring.time

    def score(self, counts_LE: np.ndarray, batches: list | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None,
                                                                          list]:
        """(imbalance [R, L], balancedness [R], seconds [R, L] or None, shares [L, P] per rule).

        Token rules split the window's counts as they are (the same token ratios with or without
        time scored); the time dispatch, which only exists per step batch, gives the shares it
        gave over the window's batches."""
        imb, bal, sec, weights = [], [], [], []
        for name, b in zip(self.names, self.bound):
            w_LP = None if name == "time" else b(counts_LE)
            if self.time is not None:
                sec_L, batch_w_LP = time_window(self.time.cost, self.placement, b, batches)
                sec.append(sec_L)
                w_LP = batch_w_LP if w_LP is None else w_LP
            g_LG = self.placement.gpu_loads(counts_LE, w_LP)
            imb.append(stats.imbalance(g_LG))
            bal.append(stats.balancedness(g_LG))
            weights.append(w_LP)
        return np.stack(imb), np.array(bal), (np.stack(sec) if sec else None), weights


def _check_args(T: int, warmup, delay) -> tuple[int, int]:
    if warmup is None:
        if T < 2:  # the default warm-up (half the windows) would be none at all
            raise EplbError(f"the trace has {T} window: a replay needs at least 2 (warm-up windows to plan on, then "
                            f"windows to serve); record more windows, or stack traces as one history")
        warmup = T // 2
    if not is_whole(warmup) or warmup < 1:
        raise EplbError(f"warmup must be a whole number of windows >= 1, got {shown(warmup)}")
    if int(warmup) >= T:
        fix = (f"use --warmup {T - 1} or less (or smaller windows)" if T >= 2 else
               "a replay needs at least 2 windows: record more, or stack traces as one history")
        raise EplbError(f"the trace has {T} window(s), not more than the warmup ({int(warmup)}): nothing is left to "
                        f"serve; {fix}")
    if not is_whole(delay) or delay < 0:
        raise EplbError(f"delay must be a whole number of windows >= 0, got {shown(delay)}")
    return int(warmup), int(delay)


def replay(trace, *, topology: Topology, policy: str | Policy = "adaptive", settings: dict | None = None,
           warmup: int | None = None, tokens_per_window: int | None = None, delay: int = 1,
           scoring: Scoring | None = None, bytes_per_expert: int | None = None,
           references: Sequence[str] = REFERENCES, initial: Placement | None = None,
           objective: str | TimeObjective = "tokens", budget: Budget | None = None,
           plan_for: str = "even") -> ReplayResult:
    """Serve a trace window by window under an online policy (see the module docstring).

    trace: a Trace or counts [T, L, E]; topology: GPUs, slots per GPU, nodes (Topology.for_experts);
    policy / settings: an eplb.serving.policy name and its settings, or a policy object; warmup: windows
    of history only (default half); delay: windows a decision waits before its placement serves;
    scoring: rules and modeled time (default even split and per-batch re-split; with a time
    objective and no scoring, those two and the time dispatch, in modeled time too);
    initial: the placement served after the warm-up (default: the `robust` plan of the warm-up
    windows); objective: "tokens" or an eplb.dispatch.cost.TimeObjective, what the initial plan, the
    policy and the hindsight plans balance; budget: the migration budget of every decision.
    """
    t_start = time.perf_counter()
    objective = check_objective(objective)
    if scoring is None:
        scoring = Scoring(time=None if objective == "tokens" else objective)
    refs = name_tuple("references", references)
    bad = [r for r in refs if r not in REFERENCES]
    if bad:
        raise EplbError(f"unknown reference(s) {bad}: choose from {', '.join(REFERENCES)}")
    if budget is not None and not isinstance(budget, Budget):
        raise EplbError(f"budget must be an eplb.Budget (max_moves, max_moves_per_gpu, move_cost, span_cost), got "
                        f"{type(budget).__name__}")
    policy, settings = _planned_for(plan_for, policy, settings, objective)
    pol = get_policy(policy, settings, objective=objective)
    if budget is not None and not takes_budget(pol):
        raise EplbError(f"policy {type(pol).__name__} decides without a budget (its decide() takes no budget): "
                        f"drop budget, or give decide a budget parameter")
    counts_TLE, how = cut_windows(trace, tokens_per_window)
    T_all, L, E = counts_TLE.shape
    topology = size_topology(E, topology, num_layers=L)  # fits these experts; the [L, P] maps within the input limit
    warmup, delay = _check_args(T_all, warmup, delay)
    if bytes_per_expert is not None:
        bytes_per_expert = positive_integer("bytes_per_expert", bytes_per_expert)
        if bytes_per_expert > 2**62 // (L * topology.num_slots):  # the most a window can move, in int64
            raise EplbError(f"bytes_per_expert ({bytes_per_expert}) x the {L * topology.num_slots} slots a window "
                            f"can move exceeds 2**62 bytes: give the size of one expert's weights in bytes")
    counts_f = counts_TLE.astype(np.float64)
    batches = _batches(scoring, trace, tokens_per_window, counts_f, warmup, topology.num_gpus)
    initial, start_note = _initial(initial, counts_f[:warmup], topology, objective, plan_for)
    t0 = time.perf_counter()
    for t in range(warmup):
        pol.observe(counts_f[t], initial)
    warmup_s = time.perf_counter() - t0
    served = _serve(pol, initial, counts_f, warmup, delay, budget, scoring, batches)
    ref_scores = {name: _reference(name, initial, counts_f[warmup:], topology, scoring, batches, objective)
                  for name in refs}
    notes = (how, start_note) + (() if scoring.time is None else (batches.how,))
    G = topology.num_gpus
    return ReplayResult(
        policy=getattr(pol, "name", type(pol).__name__),
        settings=dict(settings or {}), topology=topology, rules=scoring.names, warmup=warmup, delay=delay,
        window_T=np.arange(warmup, T_all), phy2log_TLP=served.phy2log_TLP, weights_TLP=served.weights_TLP,
        weights_rule=scoring.names[scoring.weights_index], counts_TLE=counts_TLE[warmup:],
        scores=served.scores, references=ref_scores,
        decided_T=served.decided_T, applied_T=served.applied_T, moves_T=served.moves_T, rounds_T=served.rounds_T,
        bytes_T=None if bytes_per_expert is None else served.moves_T * int(bytes_per_expert),
        seconds=time.perf_counter() - t_start, policy_seconds=served.policy_seconds + warmup_s,
        memory_bytes=int(pol.memory_bytes),
        notes=notes, time=None if scoring.time is None else {**scoring.time.describe(G), "how": batches.how},
        objective="tokens" if objective == "tokens" else objective.name,
    )


def _initial(initial: Placement | None, history_TLE: np.ndarray, topology: Topology, objective,
             plan_for: str) -> tuple[Placement, str]:
    """The placement served after the warm-up (given, or the robust plan of the warm-up
    windows, searched for the re-split rule when planning for it), and a note saying which."""
    G, E, N = topology.num_gpus, history_TLE.shape[2], topology.num_nodes
    L = history_TLE.shape[1]
    note = "initial placement: " + ("given" if initial is not None else "robust plan of the warm-up windows")
    if initial is None:
        phy_LP = plan(history_TLE, topology=topology, planner="robust", objective=objective).solution.phy2log_LP
        if plan_for == "resplit":
            phy_LP = resplit_repair(phy_LP, history_TLE, G, rounds=PLAN_ROUNDS)[0]
            note += ", searched for the re-split rule"
        return Placement(phy_LP, G, E, N), note
    if initial.phy2log_LP.shape != (L, topology.num_slots) or initial.num_gpus != G:
        raise EplbError(f"initial placement is {initial.num_layers} x {initial.num_slots} slots on {initial.num_gpus} "
                        f"GPUs; the replay needs {L} x {topology.num_slots} on {G}")
    return Placement(initial.phy2log_LP, G, E, N), note


@dataclass(frozen=True, eq=False)
class _Served:
    """The policy's run over the served windows (the loop of `_serve`)."""

    phy2log_TLP: np.ndarray
    weights_TLP: np.ndarray
    scores: RunScores
    decided_T: np.ndarray
    applied_T: np.ndarray
    moves_T: np.ndarray
    rounds_T: np.ndarray
    policy_seconds: float
    """Seconds the policy spent observing and deciding in the loop."""


def _serve(pol: Policy, initial: Placement, counts_TLE: np.ndarray, warmup: int, delay: int,
           budget: Budget | None, scoring: Scoring, batches) -> _Served:
    """Steps 2 and 3 of the module docstring: serve and score each window after the warm-up,
    then let the policy observe it and decide; a decision's placement serves `delay` windows on."""
    T_all, L, E = counts_TLE.shape
    G, N, P = initial.num_gpus, initial.num_nodes, initial.num_slots
    Ts, R = T_all - warmup, len(scoring.rules)
    phy_TLP, weights_TLP = np.empty((Ts, L, P), dtype=np.int64), np.empty((Ts, L, P))
    imb_RTL, bal_RT = np.empty((R, Ts, L)), np.empty((R, Ts))
    sec_RTL = np.empty((R, Ts, L)) if scoring.time is not None else None
    decided, applied = np.zeros(Ts, dtype=bool), np.zeros(Ts, dtype=bool)
    moves_T, rounds_T = np.zeros(Ts, dtype=np.int64), np.zeros(Ts, dtype=np.int64)
    cur, scorer, pending, t_pol = initial, _Scorer(initial, scoring), None, 0.0
    for i, t in enumerate(range(warmup, T_all)):
        if pending is not None and pending[1] == t:
            cur, scorer, pending = pending[0], _Scorer(pending[0], scoring), None
            applied[i] = True
        imb_RTL[:, i], bal_RT[:, i], sec, w = scorer.score(counts_TLE[t], batches[i])
        if sec_RTL is not None:
            sec_RTL[:, i] = sec
        phy_TLP[i], weights_TLP[i] = cur.phy2log_LP, w[scoring.weights_index]
        t0 = time.perf_counter()
        pol.observe(counts_TLE[t], cur)
        if pending is None and t + 1 + delay < T_all:
            d = pol.decide(cur) if budget is None else pol.decide(cur, budget)
            if d is not None:
                new = Placement(d.phy2log_LP, G, E, N)
                moves_T[i] = int(count_moves(cur.phy2log_LP, new.phy2log_LP, G, E).sum())
                rounds_T[i] = schedule(cur.phy2log_LP, new.phy2log_LP, G, E).num_rounds
                decided[i] = True
                pending = (new, t + 1 + delay)
        t_pol += time.perf_counter() - t0
    return _Served(phy_TLP, weights_TLP, RunScores(imb_RTL, bal_RT, sec_RTL), decided, applied, moves_T, rounds_T,
                   t_pol)


def _planned_for(plan_for, policy, settings, objective) -> tuple:
    """(policy, settings) that plan for the rule `plan_for`: the adaptive policy by name is given
    rule=plan_for; a policy that plans for another rule is refused."""
    if plan_for not in ("even", "resplit"):
        raise EplbError(f"plan_for must be 'even' or 'resplit' (the dispatch rule the engine serves), got {plan_for!r}")
    if plan_for == "even":
        return policy, settings
    if objective != "tokens":
        raise EplbError("plan_for='resplit' plans token counts: drop the time objective, or plan for 'even'")
    if policy == "adaptive":
        if (settings or {}).get("rule", "resplit") != "resplit":
            raise EplbError(f"plan_for='resplit' with the adaptive policy's rule={settings['rule']!r}: "
                            f"drop the setting")
        return policy, {**(settings or {}), "rule": "resplit"}
    rule = "even" if policy == "window" else getattr(policy, "rule", None)
    if rule not in (None, "resplit"):
        raise EplbError(f"policy {getattr(policy, 'name', policy)!r} plans for the {rule} split, not for "
                        f"plan_for='resplit': use the adaptive or the static policy")
    return policy, settings


class _WindowBatches(list):
    """The step batches of every served window (a list of lists; empty lists without time), and
    a line saying how they were made."""

    how = ""


def _batches(scoring: Scoring, trace, tokens_per_window, counts_TLE: np.ndarray, warmup: int,
             num_gpus: int) -> _WindowBatches:
    """Batches of each served window for modeled time (the same for the policy and the references)."""
    T, L, E = counts_TLE.shape
    out = _WindowBatches([] for _ in range(T - warmup))
    obj = scoring.time
    if obj is None:
        return out
    check_batches(T - warmup, scoring.batches_per_window, L, E)
    model = obj.cost.model
    if E != model.num_logical_experts or L > model.num_moe_layers:
        raise EplbError(f"the trace has {L} MoE layers x {E} experts but {model.name} has {model.num_moe_layers} x "
                        f"{model.num_logical_experts}: pick the model the trace was recorded from")
    B, K = obj.tokens_for(num_gpus), model.top_k
    tokens = _window_tokens(trace, tokens_per_window, T)
    if tokens is not None and tokens[0].shape[2] != K:
        raise EplbError(f"the trace's tokens pick {tokens[0].shape[2]} experts each but {model.name}'s top-k is {K}: "
                        f"pick the model the trace was recorded from")
    for i, t in enumerate(range(warmup, T)):
        rng = np.random.default_rng([scoring.seed, t])
        out[i] = window_batches(counts_TLE[t], K, B, scoring.batches_per_window, rng, t,
                                None if tokens is None else tokens[t])
    n = scoring.batches_per_window
    out.how = (f"up to {n} runs of {B:,} consecutive tokens per window (its own tokens: exact all-to-all bytes)"
               if tokens is not None else
               f"{n} batches of {B:,} tokens drawn per window from its counts (seed {scoring.seed}): independent "
               f"expert choices assumed for counts and all-to-all bytes")
    return out


def _window_tokens(trace, tokens_per_window, T: int) -> list[np.ndarray] | None:
    """Per-token expert choices of each window, [N_t, L, K] each, when the trace has them."""
    if not isinstance(trace, Trace) or trace.topk_ids_NLK is None:
        return None
    ids = trace.topk_ids_NLK
    if tokens_per_window is not None:
        K = int(tokens_per_window)
        return [ids[t * K:(t + 1) * K] for t in range(T)]
    return [ids[trace.token_window_N == t] for t in range(T)] if (np.bincount(trace.token_window_N,
                                                                             minlength=T) > 0).all() else None


def _reference(name: str, initial: Placement, counts_TLE: np.ndarray, topology: Topology, scoring: Scoring,
               batches: list, objective) -> RunScores:
    """Scores of the static plan (kept) or of hindsight (greedy on each served window)."""
    T = counts_TLE.shape[0]
    R, L = len(scoring.rules), counts_TLE.shape[1]
    imb, bal = np.empty((R, T, L)), np.empty((R, T))
    sec = np.empty((R, T, L)) if scoring.time is not None else None
    scorer = _Scorer(initial, scoring) if name == "static" else None
    for t in range(T):
        if name == "hindsight":
            # The planner's map only: PlanResult.placement would also score a contiguous baseline.
            sol = plan(counts_TLE[t], topology=topology, planner="greedy", objective=objective).solution
            scorer = _Scorer(Placement(sol.phy2log_LP, topology.num_gpus, counts_TLE.shape[2], topology.num_nodes),
                             scoring)
        imb[:, t], bal[:, t], s, _ = scorer.score(counts_TLE[t], batches[t])
        if sec is not None:
            sec[:, t] = s
    return RunScores(imb, bal, sec)
