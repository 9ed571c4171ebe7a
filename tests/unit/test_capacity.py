"""Capacity planner: worked KV figures, published parameter counts, and the slot/concurrency trade."""

import dataclasses

import pytest

from eplb.errors import EplbError
from eplb.stats.capacity import (
    PRESETS,
    Deployment,
    ModelShape,
    auto_slots_per_gpu,
    bytes_per_expert,
    get_model,
    kv_bytes_per_token,
    parse_memory,
    plan_capacity,
)

# Worked figures ---------------------------------------------------------------------------------

def test_llama_70b_fp16_kv_is_320_kib_per_token_and_100k_tokens_about_32_gb():
    llama = get_model("llama-3.1-70b")
    per_token = kv_bytes_per_token(llama, "fp16")
    assert per_token == 327_680 == 320 * 1024  # 2 x 80 layers x 8 kv heads x 128 dims x 2 bytes
    assert 32e9 < 100_000 * per_token < 33e9  # "about 32 GB"
    assert kv_bytes_per_token(llama, "fp8") == per_token // 2


def test_deepseek_v3_mla_kv_is_layers_times_latent_plus_rope():
    ds = get_model("deepseek-v3")
    assert kv_bytes_per_token(ds, "bf16") == 61 * (512 + 64) * 2 == 70_272
    assert kv_bytes_per_token(ds, "fp8") == 61 * 576
    # The same model with plain MHA (128 heads x 128 dims) would cache ~57x more per token.
    mha = dataclasses.replace(ds, kv_lora_rank=0, num_kv_heads=128)
    assert kv_bytes_per_token(mha, "bf16") == 2 * 61 * 128 * 128 * 2
    assert kv_bytes_per_token(mha, "bf16") / kv_bytes_per_token(ds, "bf16") > 50


def test_qwen3_gqa_kv():
    assert kv_bytes_per_token(get_model("qwen3-235b-a22b"), "bf16") == 2 * 94 * 4 * 128 * 2


@pytest.mark.parametrize("name, published", [
    ("deepseek-v3", 671e9),      # model card: 671B total (MTP module excluded)
    ("kimi-k2", 1.0e12),         # model card: 1T total
    ("qwen3-235b-a22b", 235e9),  # 235B total
    ("llama-3.1-70b", 70.6e9),   # 70.6B
])
def test_presets_match_published_parameter_counts(name, published):
    assert PRESETS[name].total_params() == pytest.approx(published, rel=0.03)


def test_bytes_per_expert_follows_dtype():
    ds = get_model("deepseek-v3")
    assert bytes_per_expert(ds, "bf16") == 3 * 7168 * 2048 * 2
    assert bytes_per_expert(ds, "fp8") == 3 * 7168 * 2048
    assert bytes_per_expert(ds, "fp4") == 3 * 7168 * 2048 // 2
    with pytest.raises(EplbError, match="dense model"):
        bytes_per_expert(get_model("llama-3.1-70b"))


def test_parse_memory_units_and_gpu_names():
    assert parse_memory("80GiB") == 80 * 2**30
    assert parse_memory("141GB") == 141 * 10**9
    assert parse_memory("81559MiB") == parse_memory("h100") == 81559 * 2**20
    assert parse_memory(96) == 96 * 2**30
    with pytest.raises(EplbError, match="not a size"):
        parse_memory("lots")


# The trade between redundant slots and sequences ---------------------------------------------------

def _dep(**kw):
    base = dict(num_gpus=32, gpu_memory=parse_memory("h200"), context=8192, concurrency=2048)
    base.update(kw)
    return Deployment(**base)


def test_redundant_slots_that_fit_leave_memory_non_negative_and_one_more_does_not():
    ds = get_model("deepseek-v3")
    rep = plan_capacity(ds, _dep())
    assert rep.redundant_per_gpu is not None and rep.redundant_per_gpu > 0
    assert rep.fits and 0 <= rep.free_bytes_per_gpu < rep.bytes_per_slot
    assert rep.bytes_per_slot == 58 * bytes_per_expert(ds, "fp8")
    assert rep.base_slots_per_gpu == 8 and rep.slots_per_gpu == 8 + rep.redundant_per_gpu
    # Budget identity: everything on the GPU adds up to the usable memory.
    used = rep.dense_bytes_per_gpu + rep.expert_bytes_per_gpu + rep.kv_bytes_per_gpu
    assert used + rep.free_bytes_per_gpu == pytest.approx(rep.usable_bytes)
    # Chosen redundancy -> the concurrency it leaves is at least what was asked.
    back = plan_capacity(ds, _dep(concurrency=None), redundant_per_gpu=rep.redundant_per_gpu)
    assert back.concurrency >= 2048
    more = plan_capacity(ds, _dep(concurrency=None), redundant_per_gpu=rep.redundant_per_gpu + 1)
    assert more.concurrency < 2048


def test_more_sequences_leave_fewer_slots_and_tradeoff_is_monotone():
    ds = get_model("deepseek-v3")
    few = plan_capacity(ds, _dep(concurrency=512)).redundant_per_gpu
    many = plan_capacity(ds, _dep(concurrency=4096)).redundant_per_gpu
    assert few > many
    conc = [c for _, c in plan_capacity(ds, _dep(concurrency=None), redundant_per_gpu=4).tradeoff]
    assert conc == sorted(conc, reverse=True) and len(conc) >= 2


def test_mla_frees_room_for_replicas_compared_with_gqa_cache():
    ds = get_model("deepseek-v3")
    gqa = dataclasses.replace(ds, name="DeepSeek-V3 with a GQA-8 cache", kv_lora_rank=0, num_kv_heads=8,
                              qk_rope_head_dim=0)
    assert plan_capacity(ds, _dep()).redundant_per_gpu > (plan_capacity(gqa, _dep()).redundant_per_gpu or 0)


def test_tensor_parallel_attention_replicates_the_mla_latent():
    ds = get_model("deepseek-v3")
    dp = plan_capacity(ds, _dep(attention="dp"))
    tp = plan_capacity(ds, _dep(attention="tp"))
    assert tp.kv_bytes_per_gpu == pytest.approx(32 * dp.kv_bytes_per_gpu)  # every GPU holds every sequence
    assert tp.dense_bytes_per_gpu < dp.dense_bytes_per_gpu


def test_not_fitting_is_reported_not_hidden():
    ds = get_model("deepseek-v3")
    rep = plan_capacity(ds, _dep(gpu_memory=parse_memory("h100"), concurrency=100_000))
    assert rep.redundant_per_gpu is None and not rep.fits and rep.free_bytes_per_gpu < 0
    with pytest.raises(EplbError, match="does not fit 100000 sequences"):
        auto_slots_per_gpu(ds, _dep(gpu_memory=parse_memory("h100"), concurrency=100_000), 256)


def test_dense_model_reports_concurrency_and_refuses_redundancy():
    llama = get_model("llama-3.1-70b")
    rep = plan_capacity(llama, Deployment(num_gpus=8, gpu_memory=parse_memory("h100"), context=100_000,
                                          weight_dtype="bf16", attention="tp"))
    assert rep.redundant_per_gpu is None and rep.concurrency >= 1 and rep.fits
    with pytest.raises(EplbError, match="dense model"):
        plan_capacity(llama, _dep(), redundant_per_gpu=1)


def test_auto_slots_checks_expert_count_of_the_trace():
    with pytest.raises(EplbError, match="384 experts but the trace has 256"):
        auto_slots_per_gpu(get_model("kimi-k2"), _dep(), 256)


@pytest.mark.parametrize("kw, msg", [
    (dict(num_gpus=0), "num_gpus must be a positive integer, got 0"),
    (dict(context=-5), "context must be a positive integer, got -5"),
    (dict(kv_dtype="int3"), "unknown dtype 'int3'"),
    (dict(attention="pp"), "attention must be one of dp, tp, got 'pp'"),
    (dict(memory_utilization=1.5), r"memory_utilization must be a number in \(0, 1\], got 1.5"),
    (dict(memory_utilization="abc"), r"memory_utilization must be a number in \(0, 1\], got 'abc'"),
])
def test_bad_deployment_errors_name_the_value(kw, msg):
    with pytest.raises(EplbError, match=msg):
        _dep(**kw)


def test_bad_model_numbers_and_names():
    with pytest.raises(EplbError, match="unknown model 'gpt-5'"):
        get_model("gpt-5")
    with pytest.raises(EplbError, match="num_attention_heads \\(64\\) must be a multiple of num_kv_heads \\(7\\)"):
        ModelShape("x", num_hidden_layers=2, hidden_size=64, vocab_size=10, num_attention_heads=64,
                   num_kv_heads=7, head_dim=8, intermediate_size=128)
    # More GPUs than experts is a deployment eplb plans (issue 11): one slot per GPU holds them all.
    assert plan_capacity(get_model("deepseek-v3"), _dep(num_gpus=300)).base_slots_per_gpu == 1
    with pytest.raises(EplbError, match="use at most 248"):
        plan_capacity(get_model("deepseek-v3"), _dep(concurrency=None), redundant_per_gpu=249)


def test_top_k_cannot_exceed_the_experts():
    """`eplb capacity --model deepseek-v3 --top-k 1000` described a top-1000 of 256 experts."""
    from eplb.stats.capacity import with_overrides

    with pytest.raises(EplbError, match=r"top_k \(1000\) must be at most num_logical_experts \(256\)"):
        with_overrides(get_model("deepseek-v3"), top_k=1000)


@pytest.mark.parametrize("num_gpus, heads_on_busiest", [(2, 4), (3, 3), (4, 2), (6, 2), (8, 1), (16, 1)])
def test_tensor_parallel_gqa_kv_share_is_the_busiest_gpus_whole_heads(num_gpus, heads_on_busiest):
    # Llama-3.1-70B: 8 KV heads x 128 x 80 layers x 2 (K, V) x 2 bytes = 327,680 B per token.
    # KV heads are not cut: with 3 GPUs one holds 3 of the 8 heads (was counted as a third).
    llama = get_model("llama-3.1-70b")
    rep = plan_capacity(llama, Deployment(num_gpus=num_gpus, gpu_memory=parse_memory("h200"), context=1000,
                                          concurrency=4, attention="tp", kv_dtype="bf16"))
    per_head_per_token = 2 * 80 * 128 * 2
    assert rep.kv_bytes_per_sequence_per_gpu == pytest.approx(1000 * heads_on_busiest * per_head_per_token)
    assert rep.kv_bytes_per_gpu == pytest.approx(4 * 1000 * heads_on_busiest * per_head_per_token)
