"""Single-process parts of the expert-parallel shim: replica choice, expert compute, plan checks,
measurements. The multi-process behaviour is in tests/distributed/test_ep.py."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from eplb.core.placement import Placement  # noqa: E402
from eplb.errors import EplbError  # noqa: E402
from eplb.migration import schedule  # noqa: E402
from eplb.runtime.apply import apply_placement, check_plan, migrate_weights, plan_migration  # noqa: E402
from eplb.runtime.ep import (  # noqa: E402
    ExpertParallelMoE,
    ReplicaTable,
    choose_slots,
    occurrence,
    swiglu_experts,
    weighted_choice,
)
from eplb.runtime.measure import RuntimeReport, percentiles, straggler_ratio  # noqa: E402
from eplb.runtime.model import ModelConfig, MoE  # noqa: E402


def placement_with_replicas(seed: int = 0, G: int = 4, E: int = 10, S: int = 4, weights: bool = True) -> Placement:
    rng = np.random.default_rng(seed)
    row = np.concatenate([rng.permutation(E), rng.integers(0, E, G * S - E)])
    rng.shuffle(row)
    w = None
    if weights:
        w = rng.uniform(0.0, 1.0, G * S)
        w[rng.random(G * S) < 0.2] = 0.0  # some replicas take nothing
        sums = np.zeros(E)
        np.add.at(sums, row, w)
        for e in np.flatnonzero(sums == 0):  # an expert needs some weight somewhere
            w[np.flatnonzero(row == e)[0]] = 1.0
            sums[e] = 1.0
        w = w / sums[row]
    return Placement(row[None], G, E, dispatch_weights_LP=None if w is None else w[None])


def test_occurrence_counts_rows_per_expert():
    ids = torch.tensor([3, 1, 3, 3, 0, 1])
    assert occurrence(ids, 4).tolist() == [0, 0, 1, 2, 0, 1]


@pytest.mark.parametrize("mode", ["even", "weights", "local"])
def test_every_row_goes_to_a_replica_of_its_expert(mode):
    p = placement_with_replicas()
    rng = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 10, (500,), generator=rng)
    for rank in range(4):
        t = ReplicaTable.build(p, 0, rank)
        slots = choose_slots(ids, mode, t, rank, 4)
        assert np.array_equal(p.phy2log_LP[0][slots.numpy()], ids.numpy())


def test_even_mode_splits_each_expert_evenly_over_its_replicas():
    p = placement_with_replicas(weights=False)
    ids = torch.arange(10).repeat_interleave(37)
    t = ReplicaTable.build(p, 0, rank=2)
    slots = choose_slots(ids, "even", t, 2, 4).numpy()
    for e in range(10):
        per_replica = np.bincount(slots[ids.numpy() == e], minlength=p.num_slots)[p.phy2log_LP[0] == e]
        assert per_replica.max() - per_replica.min() <= 1


def test_weighted_choice_hits_the_shares_within_one_row():
    p = placement_with_replicas(seed=3)
    t = ReplicaTable.build(p, 0, rank=1)
    ids = torch.arange(10).repeat_interleave(101)
    slots = choose_slots(ids, "weights", t, 1, 4).numpy()
    got = np.bincount(slots, minlength=p.num_slots)
    want = 101 * p.dispatch_weights_LP[0]
    assert np.all(np.abs(got - want) < 1.0 + 1e-9)
    assert np.all(got[p.dispatch_weights_LP[0] == 0] == 0)


def test_weighted_choice_spreads_rounding_over_ranks():
    # Two replicas at 50/50 and one row per rank: the ranks' phases send them to both.
    w_EX = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    count = torch.tensor([2])
    reps = [int(weighted_choice(torch.tensor([0]), w_EX, count, r, 4)) for r in range(4)]
    assert sorted(reps) == [0, 0, 1, 1]


def test_local_mode_keeps_rows_on_their_rank_when_it_can():
    p = placement_with_replicas(seed=5)
    ids = torch.arange(10).repeat(7)
    S = p.slots_per_gpu
    for rank in range(4):
        t = ReplicaTable.build(p, 0, rank)
        slots = choose_slots(ids, "local", t, rank, 4).numpy()
        here = set(p.phy2log_LP[0, rank * S:(rank + 1) * S].tolist())
        for e, s in zip(ids.tolist(), slots):
            assert (s // S == rank) == (e in here)


def test_unknown_mode_is_a_user_error():
    p = placement_with_replicas()
    with pytest.raises(EplbError, match="unknown dispatch mode"):
        choose_slots(torch.tensor([1]), "random", ReplicaTable.build(p, 0, 0), 0, 4)


def test_local_experts_equal_the_reference_model():
    torch.manual_seed(0)
    moe = MoE(ModelConfig(hidden=16, num_logical_experts=8, top_k=2, num_expert_groups=2, topk_groups=1,
                          expert_hidden=12))
    x = torch.randn(30, 16)
    torch.randint(0, 8, (30, 1))  # a draw the seeded stream below was written after
    w = torch.ones(30, 1)
    experts = torch.tensor([5, 2, 2, 7])  # a rank's slots, one expert twice
    slot = torch.randint(0, 4, (30,))
    with torch.no_grad():
        y = swiglu_experts(x, slot, moe.w_gate_EFD[experts], moe.w_up_EFD[experts], moe.w_down_EDF[experts])
        ref = moe.routed(x, experts[slot][:, None], w)
    assert torch.allclose(y, ref, atol=1e-6)
    assert swiglu_experts(x[:0], slot[:0], moe.w_gate_EFD, moe.w_up_EFD, moe.w_down_EDF).shape == (0, 16)


def test_check_plan_accepts_the_schedule_and_rejects_other_placements():
    old = Placement(np.array([[0, 1, 2, 3, 4, 5, 0, 1]]), 4, 6)
    new = Placement(np.array([[5, 4, 3, 2, 1, 0, 2, 3]]), 4, 6)
    plan = plan_migration(old, new)
    check_plan(old, new, plan)
    other = Placement(np.array([[5, 4, 3, 2, 1, 0, 4, 5]]), 4, 6)
    with pytest.raises(EplbError, match="made for other placements"):
        check_plan(old, other, plan)
    with pytest.raises(EplbError, match="same layers, slots"):
        plan_migration(old, Placement(np.arange(6)[None], 2, 6))
    # A hand-edited plan whose source slot does not hold the expert.
    bad = schedule(old.phy2log_LP, new.phy2log_LP, 4, 6)
    src = bad.src_slot_M.copy()
    m = int(np.flatnonzero(bad.src_rank_M >= 0)[0])
    src[m] = (src[m] + 1) % 8 if old.phy2log_LP[0, (src[m] + 1) % 8] != bad.expert_M[m] else (src[m] + 2) % 8
    import dataclasses
    broken = dataclasses.replace(bad, src_slot_M=src, src_rank_M=np.where(np.arange(len(src)) == m, src // 2,
                                                                          bad.src_rank_M))
    with pytest.raises(EplbError, match="does not hold expert"):
        check_plan(old, new, broken)


def test_straggler_ratio_and_percentiles():
    assert straggler_ratio(np.array([1.0, 1.0, 2.0, 0.0])) == pytest.approx(2.0)
    assert straggler_ratio(np.zeros(4)) == 1.0
    assert np.allclose(straggler_ratio(np.array([[3.0, 1.0], [2.0, 2.0]])), [1.5, 1.0])
    p = percentiles(np.arange(101.0))
    assert p == {"p50": 50.0, "p95": 95.0, "p99": 99.0}
    with pytest.raises(EplbError):
        percentiles(np.array([]))


def test_runtime_report_sums_steps_before_the_ratio():
    rows = np.array([[[4.0, 0.0]], [[0.0, 4.0]]])  # B=2, L=1, G=2: balanced over the two steps
    rep = RuntimeReport(rows, rows / 1000, rows / 1e4, np.array([[0.1, 0.2], [0.3, 0.1]]))
    s = rep.summary()
    assert s["straggler_tokens"] == pytest.approx(1.0)
    assert s["straggler_time"] == pytest.approx(1.0)
    assert rep.step_latency_B.tolist() == [0.2, 0.3]
    assert s["rows_received_per_layer_rank"] == [[4, 4]]


def _small_moe(seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    cfg = ModelConfig(hidden=16, num_logical_experts=4, top_k=2, num_expert_groups=2, topk_groups=1, expert_hidden=8)
    return MoE(cfg).requires_grad_(False)


def _routing(T: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, 16, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(T)])
    return x, ids, torch.rand(T, 2, generator=g)


def test_a_refused_placement_moves_no_weight(world_of_one):
    moe = _small_moe()
    old = Placement(np.array([[0, 1, 2, 3, 0]]), 1, 4, dispatch_weights_LP=np.array([[0.5, 1, 1, 1, 0.5]]))
    new = Placement(np.array([[3, 2, 1, 0, 1]]), 1, 4)             # no dispatch weights
    ep = ExpertParallelMoE.from_full(old, 0, moe.w_gate_EFD, moe.w_up_EFD, moe.w_down_EDF,
                                     group=world_of_one, mode="weights")
    x, ids, w = _routing()
    kept = [t.clone() for t in (ep.w_gate_SFD, ep.w_up_SFD, ep.w_down_SDF)]

    def unchanged():
        assert ep.placement is old and ep.mode == "weights"
        assert all(torch.equal(a, b) for a, b in zip(kept, (ep.w_gate_SFD, ep.w_up_SFD, ep.w_down_SDF)))
        assert torch.allclose(ep(x, ids, w), moe.routed(x, ids, w), atol=1e-6)

    # The layer's mode ('weights') does not suit `new`: refused before the weights move
    # (they used to move first, and the layer then served `old` with `new`'s weights).
    with pytest.raises(EplbError, match="needs a placement with dispatch_weights"):
        apply_placement([ep], new)
    unchanged()
    with pytest.raises(EplbError, match="unknown dispatch mode"):
        apply_placement([ep], new, mode="random")
    unchanged()
    # set_placement with weights of the wrong shape keeps the old weights too.
    with pytest.raises(EplbError, match="local expert weights have shapes"):
        ep.set_placement(old, 0, weights=tuple(t[:2].clone() for t in kept))
    unchanged()
    apply_placement([ep], new, mode="even")
    assert ep.placement is new and torch.allclose(ep(x, ids, w), moe.routed(x, ids, w), atol=1e-6)


@pytest.mark.parametrize("mode", ["even", "resplit"])
def test_bad_forward_inputs_are_named_errors_and_the_layer_keeps_serving(world_of_one, mode):
    moe = _small_moe(1)
    p = Placement(np.array([[0, 1, 2, 3, 1, 1]]), 1, 4)
    ep = ExpertParallelMoE.from_full(p, 0, moe.w_gate_EFD, moe.w_up_EFD, moe.w_down_EDF,
                                     group=world_of_one, mode=mode)
    x, ids, w = _routing(seed=1)
    out_of_range = ids.clone()
    out_of_range[3, 1] = 7
    cases = [
        ((x, out_of_range, w), r"1 expert id\(s\) outside 0\.\.3 \(first: 7\)"),      # was IndexError
        ((x, ids.masked_fill(ids == 2, -1), w), r"outside 0\.\.3 \(first: -1\)"),       # was a bincount error
        ((x, w, ids), "need integer expert ids"),                      # ids/weights swapped: was silently wrong
        ((x.to(torch.bfloat16), ids, w), "x is torch.bfloat16 but the expert weights are torch.float32"),
        ((x[:, :8], ids, w), r"x has shape \(7, 8\): need \[T, 16\]"),
        ((x[None], ids, w), r"x has shape \(1, 7, 16\)"),
        ((x, ids[:, 0], w[:, 0]), r"topk ids/weights have shapes \(7,\)/\(7,\)"),
    ]
    for args, msg in cases:
        with pytest.raises(EplbError, match=msg):
            ep(*args)
        assert torch.allclose(ep(x, ids, w), moe.routed(x, ids, w), atol=1e-6)
    # A batch of one token, int32 ids (as engines produce) and non-contiguous inputs are fine.
    xt = x.T.contiguous().T
    assert torch.allclose(ep(xt[:1], ids[:1].int(), w[:1]), moe.routed(x[:1], ids[:1], w[:1]), atol=1e-6)


def test_weights_held_as_parameters_that_require_grad_migrate(world_of_one):
    # Engines keep expert weights as nn.Parameters; in-place copies into views of a leaf that
    # requires grad raised a RuntimeError outside torch.no_grad().
    old = Placement(np.array([[0, 1, 2, 3, 0]]), 1, 4)
    new = Placement(np.array([[3, 2, 1, 0, 1]]), 1, 4)
    w = torch.nn.Parameter(torch.tensor(old.phy2log_LP, dtype=torch.float32)[:, :, None].repeat(1, 1, 3))
    migrate_weights(old, new, {"w": w}, group=world_of_one)
    assert w.requires_grad and torch.equal(w[0, :, 0], torch.tensor([3.0, 2, 1, 0, 1]))


def test_recorder_gathers_on_the_backends_own_device(world_of_one, monkeypatch):
    """gather() needs no device argument: CPU tensors for gloo, the current CUDA device for
    NCCL (which rejects CPU tensors; checked by faking the backend, no GPU here)."""
    import torch.distributed as dist

    from eplb.runtime import measure

    rec = measure.Recorder(1)
    with rec.step():
        pass
    assert rec.gather(world_of_one).step_s_BG.shape == (1, 1)
    assert measure.backend_device(world_of_one) == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert measure.backend_device(world_of_one) == torch.device("cuda", 3)
