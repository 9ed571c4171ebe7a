"""Property tests of the planning maths, each against an independent reimplementation.

Legend: T = windows, L = MoE layers, E = logical experts, G = GPUs, N = nodes, S = slots per
GPU, P = G x S physical slots, K = expert groups.

- the lower bound against every placement of tiny instances (best split by min-cut) and the
  exact LP of random placements, and against the two obvious bounds;
- every registered planner on edge shapes (E = G, P = E, P = G x E, one hot expert, ties, idle
  layers, nodes with groups that do not divide them), exact where the answer is trivial;
- `optimal_weights` against an LP written over (expert, GPU) pairs; `resplit` never above the
  even split, never worse with more sweeps, and converging to the LP, also with two copies of
  an expert on one GPU and warm starts;
- the metrics and window aggregations against plain loops; capacity against hand arithmetic;
- backtests: no plan sees a window it is scored on, leave-one-out leaves its workload out.
Hypothesis runs are derandomised and small (seconds in all).
"""

from __future__ import annotations

import inspect
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eplb import stats
from eplb.core.placement import Placement
from eplb.core.topology import Topology
from eplb.dispatch.rules import Resplitter, optimal_weights, resplit
from eplb.errors import EplbError
from eplb.evaluate import backtest as backtest_mod
from eplb.stats.capacity import Deployment, bytes_per_expert, get_model, kv_bytes_per_token, plan_capacity
from planners.api import PlanRequest, get_planner, planner_class, planner_names

FAST = settings(max_examples=25, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


# Helpers: independent reimplementations ------------------------------------------------------

def best_busiest(phy2log_P: np.ndarray, load_E: np.ndarray, num_gpus: int) -> float:
    """Best busiest GPU of one layer over every split of tokens (max-flow min-cut): the largest,
    over GPU sets A, of the load of the experts held only inside A, divided by |A|."""
    S = len(phy2log_P) // num_gpus
    gpus_of = [set(np.flatnonzero(phy2log_P == e) // S) for e in range(len(load_E))]
    best = 0.0
    for k in range(1, num_gpus + 1):
        for A in itertools.combinations(range(num_gpus), k):
            inside = sum(load_E[e] for e, gs in enumerate(gpus_of) if gs <= set(A))
            best = max(best, inside / k)
    return best


def lp_over_pairs(phy2log_P: np.ndarray, load_E: np.ndarray, num_gpus: int) -> float:
    """Best busiest GPU by an LP over (expert, GPU) pairs (not slots, unlike optimal_weights)."""
    from scipy.optimize import linprog

    S = len(phy2log_P) // num_gpus
    pairs = sorted({(int(e), p // S) for p, e in enumerate(phy2log_P)})
    n, E = len(pairs), len(load_E)
    a_eq, a_ub = np.zeros((E, n + 1)), np.zeros((num_gpus, n + 1))
    a_ub[:, n] = -1.0
    for i, (e, g) in enumerate(pairs):
        a_eq[e, i] = 1.0
        a_ub[g, i] = 1.0
    c = np.zeros(n + 1)
    c[n] = 1.0
    res = linprog(c, A_ub=a_ub, b_ub=np.zeros(num_gpus), A_eq=a_eq, b_eq=load_E, bounds=(0, None), method="highs")
    assert res.status == 0
    return float(res.fun)


def all_placements(E: int, G: int, S: int):
    """Every placement of E experts in G GPUs x S slots (as multisets per GPU), each expert >= once."""
    per_gpu = list(itertools.combinations_with_replacement(range(E), S))
    for combo in itertools.combinations_with_replacement(range(len(per_gpu)), G):
        row = np.array([e for c in combo for e in per_gpu[c]])
        if len(set(row.tolist())) == E:
            yield row


def expert_sums(phy2log_LP: np.ndarray, w_LP: np.ndarray, E: int) -> np.ndarray:
    out = np.zeros((phy2log_LP.shape[0], E))
    for l in range(phy2log_LP.shape[0]):
        for p in range(phy2log_LP.shape[1]):
            out[l, phy2log_LP[l, p]] += w_LP[l, p]
    return out


def loads_strategy(L: int, E: int):
    """Loads [L, E]: heavy-tailed, small integers (ties), one hot expert, or idle, per layer."""
    def make(args):
        seed, kinds = args
        rng = np.random.default_rng(seed)
        rows = []
        for kind in kinds:
            if kind == 0:
                rows.append(np.floor(rng.pareto(1.0, E) * 50))
            elif kind == 1:
                rows.append(rng.integers(0, 3, E).astype(float))
            elif kind == 2:
                rows.append(np.eye(1, E, int(rng.integers(E)))[0] * 1000)
            elif kind == 3:
                rows.append(np.zeros(E))
            else:
                rows.append(rng.random(E) * 1e6)
        return np.array(rows)
    return st.tuples(st.integers(0, 2**31 - 1), st.lists(st.integers(0, 4), min_size=L, max_size=L)).map(make)


# 1. Lower bound ----------------------------------------------------------------------------------

@st.composite
def tiny_instance(draw):
    G = draw(st.integers(1, 3))
    E = draw(st.integers(1, 4))
    S = draw(st.integers(max(1, -(-E // G)), max(1, -(-E // G)) + 2))
    load = draw(loads_strategy(1, E))[0]
    return load, G, S


@FAST
@given(inst=tiny_instance())
def test_lower_bound_below_every_placement_and_split(inst):
    load, G, S = inst
    lb = stats.lower_bound(load[None], G, G * S)[0]
    best = min(best_busiest(phy, load, G) for phy in all_placements(len(load), G, S))
    assert lb <= best * (1 + 1e-12) + 1e-12
    # Never looser than the obvious bounds: mean GPU load, and the hottest expert spread over
    # as many GPUs as it can have replicas.
    assert lb >= load.sum() / G * (1 - 1e-12)
    assert lb >= load.max() / min(G, G * S - len(load) + 1) * (1 - 1e-12)


@FAST
@given(seed=st.integers(0, 2**31 - 1), G=st.integers(1, 6), extra=st.integers(0, 3))
def test_lower_bound_below_the_exact_lp_of_random_placements(seed, G, extra):
    rng = np.random.default_rng(seed)
    E = int(rng.integers(G, 3 * G + 1))
    S = -(-E // G) + extra
    P = G * S
    load = np.floor(rng.pareto(1.0, (3, E)) * 100)
    phy = np.stack([rng.permutation(np.r_[np.arange(E), rng.integers(0, E, P - E)]) for _ in range(3)])
    p = Placement(phy, G, E)
    busiest = p.gpu_loads(load, optimal_weights(p, load)).max(axis=1)
    assert (busiest >= stats.lower_bound(load, G, P) * (1 - 1e-9)).all()


# 2. Every planner on edge shapes ----------------------------------------------------------------

def _fast_settings(name: str) -> dict:
    params = inspect.signature(planner_class(name).__init__).parameters
    return {k: v for k, v in (("time_limit", 0.3), ("workers", 1), ("quiet", True)) if k in params}


def _solver(name: str) -> bool:
    return "time_limit" in inspect.signature(planner_class(name).__init__).parameters


def _one_per_gpu(name: str) -> bool:
    return getattr(planner_class(name), "one_replica_per_gpu", True)


_rng = np.random.default_rng(2024)
_mixed = np.floor(_rng.pareto(1.2, (3, 12)) * 100)
_mixed[1] = 0.0
EDGE = {
    # name: (load [L, E], G, S, N, K, exact): exact = which planners must meet the bound.
    "E=G, P=E": (_rng.integers(1, 100, (2, 8)).astype(float), 8, 1, 2, 4, "all"),
    "P=G*E": (_rng.integers(1, 100, (2, 6)).astype(float), 3, 6, 1, None, "one_per_gpu"),
    "P=G*E, 3 nodes": (_rng.integers(1, 100, (1, 6)).astype(float), 3, 6, 3, 3, "one_per_gpu"),
    "one layer": (np.floor(_rng.pareto(1.2, (1, 12)) * 100), 4, 4, 2, 4, None),
    "idle layer among hot ones": (_mixed, 4, 4, 2, 4, None),
    "one expert takes all": (np.eye(1, 12, 5) * 1000, 4, 4, 1, None, "one_per_gpu"),
    "one expert takes all, 2 nodes": (np.eye(1, 12, 5) * 1000, 4, 4, 2, 3, "one_per_gpu"),
    "all tied": (np.full((2, 12), 7.0), 4, 3, 2, 6, "all"),
    "ties, replicas needed": (np.array([[5.0, 5, 5, 5, 1, 1, 1, 1, 1, 1, 1, 1]]), 4, 4, 1, None, None),
    "4 groups on 3 nodes": (_rng.integers(1, 100, (2, 12)).astype(float), 6, 3, 3, 4, None),
    "2 groups on 4 nodes": (_rng.integers(1, 100, (2, 8)).astype(float), 8, 2, 4, 2, None),
    "node per GPU": (_rng.integers(1, 100, (2, 8)).astype(float), 4, 3, 4, 2, None),
    "one GPU": (_rng.integers(1, 100, (2, 5)).astype(float), 1, 5, 1, None, "all"),
    "one expert": (np.array([[5.0]]), 1, 1, 1, None, "all"),
    "expert hotter than a GPU": (np.array([[100.0, 1, 1, 1, 1, 1, 1, 1]]), 4, 3, 2, None, None),
    "node cut leaves a node short": (np.array([[1.0, 2, 1, 1, 1, 1, 1, 0]]), 8, 4, 4, 4, None),
}


@pytest.mark.parametrize("name", planner_names())
@pytest.mark.parametrize("case", sorted(EDGE))
def test_every_planner_on_edge_shapes(name, case):
    load, G, S, N, K, exact = EDGE[case]
    L, E = load.shape
    if _solver(name) and (E > 8 or L > 1):
        load, L = load[:1], 1
        if E > 8:
            pytest.skip("solver planners: tiny shapes only")
    topo = Topology(G, S, N)
    try:
        sol = get_planner(name, **_fast_settings(name)).plan(
            PlanRequest(load, topo, history_TLE=load[None], num_expert_groups=K))
    except EplbError as exc:
        assert str(exc)  # a planner may refuse a shape, with a message
        return
    phy = np.asarray(sol.phy2log_LP)
    assert phy.shape == (L, G * S) and phy.min() >= 0 and phy.max() < E
    for l in range(L):
        assert set(phy[l].tolist()) == set(range(E)), "an expert has no replica"
        if _one_per_gpu(name):
            for g in range(G):
                on_gpu = phy[l, g * S:(g + 1) * S].tolist()
                assert len(set(on_gpu)) == S, "two replicas of one expert on one GPU"
    p = Placement(phy, G, E, N, dispatch_weights_LP=sol.dispatch_weights_LP)
    busiest = p.gpu_loads(load).max(axis=1)
    lb = stats.lower_bound(load, G, G * S)
    assert (busiest >= lb * (1 - 1e-9)).all()
    if exact == "all" or (exact == "one_per_gpu" and _one_per_gpu(name)):
        assert busiest == pytest.approx(lb, rel=1e-9)


# 3. Dispatch --------------------------------------------------------------------------------------

@st.composite
def placement_and_load(draw):
    """Random placements, two copies of an expert on one GPU allowed, with 2 layers of loads."""
    G = draw(st.integers(1, 4))
    S = draw(st.integers(1, 3))
    E = draw(st.integers(1, G * S))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    phy = np.stack([rng.permutation(np.r_[np.arange(E), rng.integers(0, E, G * S - E)]) for _ in range(2)])
    return Placement(phy, G, E), draw(loads_strategy(2, E))


@FAST
@given(case=placement_and_load())
def test_optimal_weights_match_an_lp_over_expert_gpu_pairs(case):
    p, load = case
    w = optimal_weights(p, load)
    assert (w >= 0).all()
    assert np.allclose(expert_sums(p.phy2log_LP, w, p.num_logical_experts), 1.0)
    got = p.gpu_loads(load, w).max(axis=1)
    for l in range(p.num_layers):
        want = lp_over_pairs(p.phy2log_LP[l], load[l], p.num_gpus)
        assert got[l] == pytest.approx(want, rel=1e-7, abs=1e-9)
        assert got[l] == pytest.approx(best_busiest(p.phy2log_LP[l], load[l], p.num_gpus), rel=1e-7, abs=1e-9)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=placement_and_load())
def test_resplit_never_above_even_never_worse_with_more_sweeps(case):
    p, load = case
    rs = Resplitter(p)
    lp = p.gpu_loads(load, optimal_weights(p, load)).max(axis=1)
    before = p.gpu_loads(load).max(axis=1)  # the even split
    for sweeps in range(5):
        w = rs(load, sweeps=sweeps)
        assert (w >= 0).all()
        assert np.allclose(expert_sums(p.phy2log_LP, w, p.num_logical_experts), 1.0)
        now = p.gpu_loads(load, w).max(axis=1)
        # A water-filling step never raises the busiest of the GPUs it touches, so no sweep
        # count ends above the even split or above fewer sweeps.
        assert (now <= before * (1 + 1e-9) + 1e-9).all(), f"{sweeps} sweeps"
        assert (now >= lp * (1 - 1e-9) - 1e-9).all()
        before = now


@FAST
@given(case=placement_and_load(), seed=st.integers(0, 2**31 - 1))
def test_resplit_warm_starts_stay_valid_and_below_even(case, seed):
    p, load = case
    rng = np.random.default_rng(seed)
    rs = Resplitter(p)
    for _ in range(3):
        batch = load * (rng.random(load.shape) < 0.7)  # experts go idle and come back
        w = rs(batch, sweeps=2, warm=True)
        assert np.allclose(expert_sums(p.phy2log_LP, w, p.num_logical_experts), 1.0)
        assert (p.gpu_loads(batch, w).max(axis=1) <= p.gpu_loads(batch).max(axis=1) * (1 + 1e-9) + 1e-9).all()


@settings(max_examples=10, deadline=None, derandomize=True)
@given(case=placement_and_load())
def test_resplit_converges_to_the_lp(case):
    p, load = case
    lp = p.gpu_loads(load, optimal_weights(p, load)).max(axis=1)
    fast = p.gpu_loads(load, resplit(p, load, sweeps=300)).max(axis=1)
    assert fast == pytest.approx(lp, rel=1e-6, abs=1e-9)


# 4. Metrics and aggregation against plain loops ---------------------------------------------------

@FAST
@given(case=placement_and_load(), num_nodes=st.sampled_from([1, 2]))
def test_evaluate_and_metrics_match_loops(case, num_nodes):
    p, load = case
    G, S, E = p.num_gpus, p.slots_per_gpu, p.num_logical_experts
    if G % num_nodes:
        num_nodes = 1
    gpu = np.zeros((p.num_layers, G))
    for l in range(p.num_layers):
        for slot, e in enumerate(p.phy2log_LP[l]):
            gpu[l, slot // S] += load[l, e] / list(p.phy2log_LP[l]).count(e)
    rep = stats.evaluate(p, load)
    assert np.allclose(rep.gpu_load_LG, gpu)
    imb = [row.max() / row.mean() if row.mean() > 0 else 1.0 for row in gpu]
    assert np.allclose(rep.imbalance_L, imb) and np.allclose(stats.imbalance(gpu), imb)
    maxes = sum(row.max() for row in gpu)
    assert rep.balancedness == pytest.approx(sum(row.mean() for row in gpu) / maxes if maxes > 0 else 1.0)
    lb = stats.lower_bound(load, G, p.num_slots)
    assert np.allclose(rep.bound_ratio_L, [m / b if b > 0 else 1.0 for m, b in zip(gpu.max(axis=1), lb)])
    for l, row in enumerate(load):
        n, total = len(row), row.sum()
        gini = sum(abs(a - b) for a in row for b in row) / (2 * n * total) if total > 0 else 0.0
        assert stats.gini(load)[l] == pytest.approx(gini, abs=1e-12)
        assert stats.hot_ratio(load)[l] == pytest.approx(row.max() / row.mean() if total > 0 else 1.0)
    # group_span: nodes holding any replica of each group of E / K consecutive experts.
    for K in [k for k in range(1, E + 1) if E % k == 0]:
        span = stats.group_span(p.phy2log_LP, Topology(G, S, num_nodes), K, E)
        for l in range(p.num_layers):
            for k in range(K):
                held = {(slot // S) // (G // num_nodes) for slot, e in enumerate(p.phy2log_LP[l]) if e // (E // K) == k}
                assert span[l, k] == len(held)


@FAST
@given(seed=st.integers(0, 2**31 - 1), T=st.integers(1, 6), alpha=st.floats(0.05, 1.0))
def test_window_aggregations_match_loops(seed, T, alpha):
    rng = np.random.default_rng(seed)
    c = rng.random((T, 2, 5)) * 10.0 ** rng.integers(-3, 8, (T, 1, 1))
    assert np.allclose(stats.aggregate(c, "sum"), sum(c[t] for t in range(T)))
    assert np.allclose(stats.aggregate(c, "mean"), sum(c[t] for t in range(T)) / T)
    assert np.array_equal(stats.aggregate(c, "last"), c[-1])
    for w in range(1, T + 1):
        assert np.allclose(stats.aggregate(c, "window", window=w), sum(c[t] for t in range(T - w, T)))
        want = [sum(c[t] for t in range(s, s + w)) for s in range(T - w + 1)]
        assert np.allclose(stats.sliding_sum(c, w), want, rtol=1e-12, atol=0)
    m, ema = c[0], [c[0]]
    for t in range(1, T):
        m = alpha * c[t] + (1 - alpha) * m
        ema.append(m)
    assert np.allclose(stats.ema(c, alpha), ema, rtol=1e-12, atol=0)
    assert np.allclose(stats.aggregate(c, "ema", alpha=alpha), ema[-1], rtol=1e-12, atol=0)


def test_window_balancedness_is_balancedness_of_each_window(rng):
    c = np.floor(rng.pareto(1.0, (5, 3, 8)) * 10)
    c[2] = 0.0
    p = Placement(np.tile(np.r_[np.arange(8), [0, 1, 2, 3]], (3, 1)), 4, 8)
    want = []
    for t in range(5):
        gpu = p.gpu_loads(c[t])
        mx = gpu.max(axis=1).sum()
        want.append(gpu.mean(axis=1).sum() / mx if mx > 0 else 1.0)
    assert np.allclose(stats.window_balancedness(p, c), want)


# 5. Capacity by hand --------------------------------------------------------------------------------

def test_capacity_deepseek_v3_by_hand():
    ds = get_model("deepseek-v3")
    assert kv_bytes_per_token(ds, "bf16") == 61 * (512 + 64) * 2 == 70_272
    assert kv_bytes_per_token(ds, "fp8") == 35_136
    assert bytes_per_expert(ds, "fp8") == 3 * 7168 * 2048 == 44_040_192
    # README's example: 32 x H200, context 8192, 2048 sequences, fp8 weights, bf16 KV.
    dep = Deployment(num_gpus=32, gpu_memory=143_771 * 2**20, context=8192, concurrency=2048)
    rep = plan_capacity(ds, dep)
    usable = int(143_771 * 2**20 * 0.9)
    kv_gpu = 64 * 8192 * 70_272                          # ceil(2048 / 32) sequences on a GPU
    slot = 58 * 44_040_192                               # one expert in every MoE layer
    room = usable - rep.dense_bytes_per_gpu - 8 * slot - kv_gpu   # 8 = 256 / 32 slots of its own
    assert rep.kv_bytes_per_gpu == kv_gpu and rep.bytes_per_slot == slot and rep.usable_bytes == usable
    assert rep.redundant_per_gpu == room // slot == 23
    assert rep.expert_bytes_per_gpu == (8 + 23) * slot
    assert rep.free_bytes_per_gpu == room - 23 * slot


def test_capacity_llama_gqa_by_hand():
    llama = get_model("llama-3.1-70b")
    assert kv_bytes_per_token(llama, "fp16") == 2 * 80 * 8 * 128 * 2 == 327_680
    assert kv_bytes_per_token(llama, "fp8") == 163_840
    dep = Deployment(num_gpus=8, gpu_memory=80 * 2**30, context=4096, attention="tp", weight_dtype="bf16",
                     kv_dtype="bf16")
    rep = plan_capacity(llama, dep)
    dense = -(-llama.total_params() * 2 // 8)             # bf16 weights split over 8 GPUs
    kv_seq = 4096 * 327_680 / 8                            # one KV head of each sequence per GPU
    assert rep.dense_bytes_per_gpu == dense and rep.kv_bytes_per_sequence_per_gpu == kv_seq
    assert rep.concurrency == int((int(80 * 2**30 * 0.9) - dense) // kv_seq)


# 6. Backtests never look ahead --------------------------------------------------------------------------

def _tagged_counts(T: int, L: int = 1, E: int = 8) -> np.ndarray:
    """Windows whose expert 0 carries the window's index + 1 (x 1000): a plan's history names them."""
    rng = np.random.default_rng(T)
    c = rng.integers(1, 50, (T, L, E)).astype(float)
    c[:, :, 0] = (np.arange(T) + 1)[:, None] * 1000
    return c


def _spy(monkeypatch):
    seen = []
    real = backtest_mod.make_plan

    def spy(history, **kw):
        h = np.asarray(history)
        if h.ndim == 3:  # planning calls pass the history windows; oracle calls one [L, E] window
            seen.append(sorted({int(v) // 1000 - 1 for v in h[:, 0, 0]}))
        return real(history, **kw)

    monkeypatch.setattr(backtest_mod, "make_plan", spy)
    return seen


@pytest.mark.parametrize("interval, history", [(1, None), (2, 3), (3, 1), (1, 4)])
def test_backtest_plans_see_only_windows_before_the_ones_they_serve(monkeypatch, interval, history):
    T = 8
    seen = _spy(monkeypatch)
    r = backtest_mod.backtest(_tagged_counts(T), num_gpus=2, planner="greedy", interval=interval, history=history,
                              dispatch=("even",), oracle=True, quiet=True)
    assert len(seen) == len(r.plans)
    for ps, windows in zip(r.plans, seen):
        assert windows == list(range(*ps.history))
        served = [w.window for w in r.windows if w.plan_index == ps.index]
        assert served and max(windows) < min(served)
        if history is not None:
            assert len(windows) == history
    assert sorted(w.window for w in r.windows) == list(range(1 if history is None else history, T))


def test_leave_one_out_plans_without_the_held_out_workload(monkeypatch):
    seen = _spy(monkeypatch)
    tagged = _tagged_counts(6)
    workloads = [tagged[0:2], tagged[2:3], tagged[3:6]]  # windows 0-1, 2, 3-5
    r = backtest_mod.leave_one_out(workloads, num_gpus=2, planner="greedy", dispatch=("even",), oracle=True,
                                   quiet=True)
    members = [{0, 1}, {2}, {3, 4, 5}]
    assert len(seen) == 3
    for i, windows in enumerate(seen):
        assert set(windows) == set().union(*members[:i], *members[i + 1:])
    assert [w.window for w in r.windows] == [0, 0, 1, 2, 2, 2]
