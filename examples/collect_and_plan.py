"""Collect a router trace from the reference DeepSeek-style model, then plan a placement from it.

    python examples/collect_and_plan.py --trace traces/deepseek.npz --gpus 8 --out collected.npz

Steps: build the reference model (MLA + MoE with DeepSeek-V3 routing) with the router shape
of the trace (E, K, groups, MoE layer ids) at a small hidden size; drive its routing with the
per-layer expert frequencies of the trace's windows (one collected window per trace window),
or, with `--natural` or when the trace file is absent, let its random-weight router choose;
record the routers with `eplb.runtime.collect.RouterCollector`; write the collected trace; plan from it
with `eplb.plan` and print the report (contiguous placement vs the planner), plus the KV-cache
bytes per token of MLA next to MHA/GQA. Runs on CPU in well under a minute.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import eplb  # noqa: E402
from eplb.commands.common import format_table  # noqa: E402
from eplb.errors import EplbError  # noqa: E402
from eplb.runtime.collect import RouterCollector  # noqa: E402
from eplb.runtime.config import ModelConfig  # noqa: E402
from eplb.runtime.model import DeepSeekModel  # noqa: E402
from eplb.stats.loads import hot_ratio  # noqa: E402


def model_config(source: eplb.Trace | None, layers: int | None) -> ModelConfig:
    """Small hidden sizes, router shape of the source trace (DeepSeek-V3's without one)."""
    small = dict(hidden=32, num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                 qk_rope_head_dim=8, v_head_dim=8, expert_hidden=16, dense_hidden=64, vocab=256)
    if source is None:
        first, n_moe, E, K, G, TG = 3, layers or 58, 256, 8, 8, 4
        return ModelConfig(num_layers=first + n_moe, first_moe_layer=first, num_logical_experts=E, top_k=K,
                           num_expert_groups=G, topk_groups=TG, name="deepseek-v3-router-tiny", **small)
    m = source.meta
    ids = source.layer_ids
    if not np.array_equal(ids, np.arange(ids[0], ids[0] + len(ids))):
        raise EplbError(f"this example needs consecutive MoE layer ids, the trace has {ids.tolist()}")
    K, G = m.get("top_k"), m.get("num_expert_groups") or 1
    if K is None:
        raise EplbError("the trace's meta has no top_k: this example needs it to build the router")
    TG = m.get("topk_groups") or max(1, G // 2)
    return ModelConfig(num_layers=int(ids[0]) + len(ids), first_moe_layer=int(ids[0]),
                       num_logical_experts=source.num_logical_experts, top_k=int(K), num_expert_groups=int(G),
                       topk_groups=int(TG),
                       name=f"{m.get('model') or 'trace'} router, tiny", **small)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="traces/deepseek.npz", help="trace whose frequencies drive the routing")
    ap.add_argument("--natural", action="store_true", help="ignore --trace: the model's own router chooses")
    ap.add_argument("--windows", type=int, default=4, help="windows to collect (one per source window)")
    ap.add_argument("--tokens-per-window", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=None, help="use only the first N MoE layers")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--redundant", type=int, default=None, help="redundant slots in total (default one per GPU)")
    ap.add_argument("--planner", default="greedy", choices=eplb.planner_names())
    ap.add_argument("--out", default="collected.npz", help="where to write the collected trace")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: the matmuls here are tiny; more threads only add "
                         "synchronisation, and on a loaded machine OpenMP spinning slows them 10x+)")
    args = ap.parse_args(argv)
    for name in ("windows", "tokens_per_window", "gpus"):
        if getattr(args, name) < 1:
            raise EplbError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.layers is not None and args.layers < 1:
        raise EplbError(f"--layers must be >= 1 (the first N MoE layers), got {args.layers}")
    torch.set_num_threads(args.threads)

    # Data: the source of routing frequencies, if any.
    source = None
    if not args.natural:
        if Path(args.trace).exists():
            source = eplb.load_trace(args.trace)
            if args.layers is not None:
                if args.layers > source.num_layers:
                    raise EplbError(f"--layers {args.layers}: {args.trace} has only {source.num_layers} MoE layers")
                source = eplb.Trace(source.counts_TLE[:, : args.layers], source.layer_ids[: args.layers],
                                    dict(source.meta, num_hidden_layers=int(source.layer_ids[args.layers - 1]) + 1))
        else:
            print(f"{args.trace} not found: using the model's own (natural) routing; "
                  f"generate the trace with eplb.stats.synth to drive it")
    cfg = model_config(source, args.layers)
    torch.manual_seed(args.seed)
    model = DeepSeekModel(cfg).eval()
    gen = torch.Generator().manual_seed(args.seed)
    seq = 128
    batch = max(1, args.tokens_per_window // seq)

    # Collect: one window per source window, each driven by that window's frequencies.
    t0 = time.perf_counter()
    routing = "natural (random-weight router)" if source is None else f"driven by {args.trace}"
    meta = {"source": f"examples/collect_and_plan.py, routing {routing}",
            "synthetic": True if source is None else bool(source.meta.get("synthetic"))}
    with RouterCollector(model, window_tokens=batch * seq, meta=meta) as rec, torch.no_grad():
        for w in range(args.windows):
            if source is not None:
                model.drive_routing(source.counts_TLE[w % source.num_windows], gen)
            model(torch.randint(0, cfg.vocab, (batch, seq), generator=gen))
    trace = rec.save(args.out)
    secs = time.perf_counter() - t0
    print(f"model {cfg.name}: {cfg.num_layers} layers ({cfg.num_moe_layers} MoE), E={cfg.num_logical_experts}, "
          f"K={cfg.top_k}, {cfg.num_expert_groups} groups (top {cfg.topk_groups}); routing {routing}")
    print(f"collected {trace.num_windows} windows x {batch * seq} tokens in {secs:.1f} s -> {args.out}")
    hr = hot_ratio(trace.total())
    print(f"hottest/mean expert per layer: median {np.median(hr):.2f}, max {np.max(hr):.2f}")
    if source is not None:
        # How faithfully did the driven routing reproduce the source's per-layer shares?
        used = np.arange(args.windows) % source.num_windows
        want = source.counts_TLE[used].sum(0).astype(float)
        got = trace.total().astype(float)
        share_err = np.abs(got / got.sum(1, keepdims=True) - want / want.sum(1, keepdims=True)).max()
        print(f"max |collected share - source share| over (layer, expert): {share_err:.4f}")

    # KV cache: MLA keeps the latent + RoPE key; MHA/GQA keep K and V per KV head.
    rows = []
    for name, c in (("this model", cfg), ("DeepSeek-V3", ModelConfig.deepseek_v3())):
        rows.append([name, c.kv_bytes_per_token(), c.mha_kv_bytes_per_token(),
                     c.mha_kv_bytes_per_token(kv_heads=max(1, c.num_heads // 16)),
                     c.mha_kv_bytes_per_token() / c.kv_bytes_per_token()])
    print("\nKV-cache bytes per token (bf16, all layers)")
    print(format_table(["model", "MLA", "MHA (H x v_head_dim)", "GQA (H/16 KV heads)", "MHA / MLA"], rows))

    # Plan from the collected trace.
    result = eplb.plan(trace, num_gpus=args.gpus, num_redundant=args.redundant, planner=args.planner)
    pl = result.placement
    print(f"\nplan: {pl.num_gpus} GPUs, {pl.num_slots} slots ({pl.num_slots - pl.num_logical_experts} redundant)")
    rows = []
    for name, rep in (("contiguous (no EPLB)", result.before), (result.planner, result.after)):
        rows.append([name, float(np.median(rep.imbalance_L)), float(np.max(rep.imbalance_L)),
                     float(np.median(rep.bound_ratio_L)), rep.balancedness])
    print(format_table(["placement", "busiest/mean GPU median", "max", "/bound median", "balancedness"], rows))
    print(f"planner {result.planner}: {result.status} in {result.seconds * 1e3:.0f} ms"
          + (f" ({result.message})" if result.message else ""))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except EplbError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
