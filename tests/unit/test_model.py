"""Reference DeepSeek-style model: routing rules, MoE math, MLA cache, trace-driven routing."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from eplb.errors import EplbError  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")
from eplb.runtime.model import (  # noqa: E402
    DeepSeekModel,
    MLAttention,
    ModelConfig,
    MoE,
    Router,
    inclusion_probs,
    sample_distinct,
    swiglu,
)


@pytest.fixture
def cfg():
    return ModelConfig()


def test_kv_bytes_deepseek_v3():
    # DeepSeek-V3: 61 layers x (512 latent + 64 RoPE) x 2 bytes = 70,272 bytes per token;
    # MHA with 128 heads of 128 dims would need 2 x 61 x 128 x 128 x 2 = 3,997,696 (57x).
    v3 = ModelConfig.deepseek_v3()
    assert v3.kv_bytes_per_token() == 61 * 576 * 2 == 70272
    assert v3.mha_kv_bytes_per_token() == 2 * 61 * 128 * 128 * 2 == 3997696
    assert v3.mha_kv_bytes_per_token(kv_heads=8, head_dim=128, dtype_bytes=1) == 2 * 61 * 8 * 128
    assert v3.num_moe_layers == 58 and v3.moe_layer_ids[0] == 3 and v3.moe_layer_ids[-1] == 60


@pytest.mark.parametrize("bad, msg", [
    (dict(num_logical_experts=10, num_expert_groups=4), "divisible by num_expert_groups"),
    (dict(topk_groups=5), "topk_groups"),
    (dict(top_k=9, topk_groups=2), "exceeds"),
    (dict(first_moe_layer=4), "at least one MoE layer"),
    (dict(hidden=0), "hidden must be >= 1"),
    (dict(qk_rope_head_dim=7), "even"),
])
def test_config_rejects_bad_shapes(bad, msg):
    with pytest.raises(EplbError, match=msg):
        ModelConfig(**bad)


def _router_reference(r: Router, x):
    """Token-by-token DeepSeek-V3 gate, written with plain Python loops."""
    s = torch.sigmoid(x.float() @ r.weight.float().T)
    b = s + r.e_score_correction_bias
    per = r.num_logical_experts // r.num_expert_groups
    ids, ws = [], []
    for t in range(x.shape[0]):
        gscore = [sorted(b[t, g * per:(g + 1) * per].tolist(), reverse=True)[:2] for g in range(r.num_expert_groups)]
        gscore = [sum(v) for v in gscore]
        groups = sorted(range(r.num_expert_groups), key=lambda g: -gscore[g])[: r.topk_groups]
        cand = [e for g in groups for e in range(g * per, (g + 1) * per)]
        chosen = sorted(cand, key=lambda e: -b[t, e].item())[: r.top_k]
        w = s[t, chosen]
        ids.append(chosen)
        ws.append((w / w.sum() * r.routed_scaling).tolist())
    return torch.tensor(ids), torch.tensor(ws)


def test_router_matches_loop_reference_with_bias(cfg):
    torch.manual_seed(0)
    r = Router(cfg)
    # A bias that favours the last group changes which experts win, not their weights' source.
    r.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.2, cfg.num_logical_experts))
    x = torch.randn(40, cfg.hidden)
    ids, w = r(x)
    ref_ids, ref_w = _router_reference(r, x)
    assert ids.dtype == torch.int64 and ids.shape == (40, cfg.top_k)
    assert torch.equal(ids.sort(1).values, ref_ids.sort(1).values)
    assert torch.allclose(w.sum(1), torch.full((40,), cfg.routed_scaling))
    order = ids.argsort(1), ref_ids.argsort(1)
    assert torch.allclose(w.gather(1, order[0]), ref_w.gather(1, order[1]), atol=1e-6)


def test_router_group_limit(cfg):
    torch.manual_seed(1)
    r = Router(cfg)
    ids, _ = r(torch.randn(200, cfg.hidden))
    groups = ids // (cfg.num_logical_experts // cfg.num_expert_groups)
    assert all(len(set(row)) <= cfg.topk_groups for row in groups.tolist())


def test_moe_forward_is_shared_plus_weighted_experts(cfg):
    torch.manual_seed(2)
    moe = MoE(cfg)
    x = torch.randn(12, cfg.hidden)
    ids, w = moe.gate(x)
    expect = moe.shared(x).clone()
    for t in range(12):
        for k in range(cfg.top_k):
            e = ids[t, k]
            expect[t] += w[t, k] * swiglu(x[t:t + 1], moe.w_gate_EFD[e], moe.w_up_EFD[e], moe.w_down_EDF[e])[0]
    assert torch.allclose(moe(x), expect, atol=1e-5)
    assert torch.allclose(moe.routed(x, ids, w), expect - moe.shared(x), atol=1e-5)


def test_mla_cache_holds_only_latent_and_matches_full_forward():
    cfg = ModelConfig(q_lora_rank=0)  # also covers the full-rank query path
    torch.manual_seed(3)
    model = DeepSeekModel(cfg).eval()
    tokens = torch.randint(0, cfg.vocab, (2, 9))
    with torch.no_grad():
        full = model(tokens)
        caches = model.new_caches()
        steps = [model(tokens[:, :5], caches)] + [model(tokens[:, i:i + 1], caches) for i in range(5, 9)]
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)
    # Cache bytes = batch x tokens x the config's per-token MLA figure (float32 = 4 bytes).
    assert sum(c.nbytes() for c in caches) == 2 * 9 * cfg.kv_bytes_per_token(dtype_bytes=4)


def test_attention_is_causal():
    cfg = ModelConfig()
    torch.manual_seed(4)
    attn = MLAttention(cfg)
    x = torch.randn(1, 6, cfg.hidden)
    y = attn(x)
    x2 = x.clone()
    x2[:, 4:] += 1.0
    assert torch.allclose(attn(x2)[:, :4], y[:, :4], atol=1e-6)


def test_inclusion_probs_caps_at_one():
    pi = inclusion_probs([10.0, 1, 1, 1, 1], 2)
    assert pi[0] == 1.0 and np.isclose(pi.sum(), 2.0) and np.allclose(pi[1:], 0.25)
    assert np.allclose(inclusion_probs([1, 2, 3, 2], 2), np.array([1, 2, 3, 2]) / 4)
    with pytest.raises(EplbError, match="non-zero share"):
        inclusion_probs([1, 0, 0, 0], 2)


def test_sample_distinct_marginals_and_distinctness():
    rng = np.random.default_rng(0)
    f = rng.pareto(1.2, 32) + 0.05
    pi = inclusion_probs(f, 6)
    g = torch.Generator().manual_seed(0)
    T = 40000
    ids = sample_distinct(torch.tensor(pi), T, 6, g)
    assert ids.shape == (T, 6)
    s = ids.sort(1).values
    assert not (s[:, 1:] == s[:, :-1]).any()
    freq = torch.bincount(ids.flatten(), minlength=32).numpy() / T
    # Binomial standard error of a frequency over 40k tokens is <= 0.0025.
    assert np.abs(freq - pi).max() < 0.012


def test_drive_routing_reproduces_trace_skew_and_turns_off(cfg):
    torch.manual_seed(5)
    model = DeepSeekModel(cfg)
    L, E = cfg.num_moe_layers, cfg.num_logical_experts
    freq = np.random.default_rng(1).integers(1, 50, size=(L, E)).astype(float)
    model.drive_routing(freq, torch.Generator().manual_seed(1))
    moe = model.moe_layers()[0][1]
    x = torch.randn(20000, cfg.hidden)
    ids, w = moe.gate(x)
    got = torch.bincount(ids.flatten(), minlength=E).numpy() / 20000
    assert np.abs(got - inclusion_probs(freq[0], cfg.top_k)).max() < 0.02
    assert torch.allclose(w.sum(1), torch.full((20000,), cfg.routed_scaling))
    model.drive_routing(None)
    assert not moe.gate.driven
    with pytest.raises(EplbError, match=r"\[3 MoE layers, 16 experts\]"):
        model.drive_routing(np.ones((2, E)))


def test_moe_layers_ids(cfg):
    model = DeepSeekModel(ModelConfig(num_layers=5, first_moe_layer=2))
    assert [i for i, _ in model.moe_layers()] == [2, 3, 4]


def test_router_and_moe_take_a_batch_of_no_tokens(cfg):
    # An idle data-parallel rank still calls its router (the EP all-to-all needs every rank).
    torch.manual_seed(6)
    moe = MoE(cfg)
    x = torch.randn(0, cfg.hidden)
    ids, w = moe.gate(x)
    assert ids.shape == (0, cfg.top_k) and w.shape == (0, cfg.top_k)
    assert moe(x).shape == (0, cfg.hidden)
    model = DeepSeekModel(cfg).eval()
    with torch.no_grad():
        assert model(torch.zeros(0, 5, dtype=torch.long)).shape == (0, 5, cfg.vocab)


def test_routed_takes_float32_router_weights_with_bf16_activations(cfg):
    torch.manual_seed(7)
    moe = MoE(cfg).to(torch.bfloat16)
    x = torch.randn(9, cfg.hidden, dtype=torch.bfloat16)
    ids = torch.randint(0, cfg.num_logical_experts, (9, cfg.top_k))
    w = torch.rand(9, cfg.top_k)
    with torch.no_grad():
        y = moe.routed(x, ids, w)
        assert y.dtype == torch.bfloat16
        assert torch.equal(y, moe.routed(x, ids, w.to(torch.bfloat16)))
