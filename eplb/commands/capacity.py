"""`eplb capacity`: how many redundant expert slots fit next to the KV cache on each GPU.

Also the capacity options `eplb plan --slots-per-gpu auto` shares (`add_arguments`,
`slots_from_args`) and the printed report (`format_report`); the memory model itself is
eplb.stats.capacity.
"""

from __future__ import annotations

import argparse

from eplb.commands.common import add_command, add_output_flags, print_json
from eplb.core.topology import Topology
from eplb.errors import EplbError
from eplb.stats.capacity import (
    ATTENTION_MODES,
    DTYPE_BITS,
    GPU_MEMORY_MIB,
    PRESETS,
    CapacityReport,
    Deployment,
    ModelShape,
    auto_slots_per_gpu,
    get_model,
    gib,
    parse_memory,
    plan_capacity,
    with_overrides,
)

# Explicit model numbers: option name -> ModelShape field.
NUMBERS = {
    "layers": "num_hidden_layers", "dense_layers": "num_dense_layers", "hidden": "hidden_size",
    "vocab": "vocab_size", "heads": "num_attention_heads", "kv_heads": "num_kv_heads",
    "head_dim": "head_dim", "intermediate": "intermediate_size", "experts": "num_logical_experts",
    "expert_intermediate": "moe_intermediate_size", "shared_experts": "num_shared_experts",
    "top_k": "top_k", "kv_lora_rank": "kv_lora_rank", "q_lora_rank": "q_lora_rank",
    "rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
}


def add_arguments(p, *, for_plan: bool = False) -> None:
    """Capacity options shared by `eplb capacity` and `eplb plan --slots-per-gpu auto`."""
    g = p.add_argument_group("capacity" + (" (with --slots-per-gpu auto)" if for_plan else ""))
    g.add_argument("--model", "-m", help=f"model preset: {', '.join(PRESETS)}"
                   + ("" if for_plan else " (or give --layers ... numbers)"))
    g.add_argument("--gpu-memory", help="memory per GPU: 80GiB, 141GB, 81559MiB, or a GPU name "
                   f"({', '.join(GPU_MEMORY_MIB)})")
    g.add_argument("--context", type=int, help="tokens of KV cache per sequence")
    g.add_argument("--concurrency", type=int, help="sequences in flight over all GPUs")
    g.add_argument("--weight-dtype", default="fp8", choices=list(DTYPE_BITS),
                   help="dtype of the weights (default fp8)")
    g.add_argument("--expert-dtype", choices=list(DTYPE_BITS),
                   help="dtype of the routed experts (default: weight dtype)")
    g.add_argument("--kv-dtype", default="bf16", choices=list(DTYPE_BITS), help="dtype of the KV cache (default bf16)")
    g.add_argument("--attention", default="dp", choices=list(ATTENTION_MODES),
                   help="dp: attention weights on every GPU, each sequence on one GPU (default); "
                        "tp: attention weights and KV heads split over GPUs")
    g.add_argument("--memory-utilization", type=float, default=0.9,
                   help="share of GPU memory for weights + KV (default 0.9)")


def deployment_from_args(args, num_gpus: int, *, need_concurrency: bool = False) -> Deployment:
    """A Deployment from the options `add_arguments` defines (errors name the missing one)."""
    missing = [f"--{n.replace('_', '-')}" for n in ("gpu_memory", "context") if getattr(args, n) is None]
    if need_concurrency and args.concurrency is None:
        missing.append("--concurrency")
    if missing:
        raise EplbError(f"capacity planning needs {', '.join(missing)}")
    return Deployment(
        num_gpus=num_gpus, gpu_memory=parse_memory(args.gpu_memory), context=args.context,
        concurrency=args.concurrency, weight_dtype=args.weight_dtype, expert_dtype=args.expert_dtype,
        kv_dtype=args.kv_dtype, attention=args.attention, memory_utilization=args.memory_utilization,
    )


def slots_from_args(args, num_logical_experts: int) -> CapacityReport:
    """`eplb plan --slots-per-gpu auto`: size the slots from the capacity options in `args`."""
    if not getattr(args, "model", None):
        raise EplbError(f"--slots-per-gpu auto needs --model (one of {', '.join(PRESETS)}) and the memory "
                        f"options --gpu-memory, --context, --concurrency")
    dep = deployment_from_args(args, args.gpus, need_concurrency=True)
    return auto_slots_per_gpu(get_model(args.model), dep, num_logical_experts)


def _fmt_bytes(n: float) -> str:
    if abs(n) >= 2**30:
        return f"{n / 2**30:,.2f} GiB"
    if abs(n) >= 2**20:
        return f"{n / 2**20:,.1f} MiB"
    if abs(n) >= 2**10:
        return f"{n / 2**10:,.1f} KiB"
    return f"{n:,.0f} B"


def format_report(rep: CapacityReport) -> str:
    """The human-readable report `eplb capacity` prints."""
    d, m = rep.deployment, rep.model
    lines = [m.describe(),
             f"{d.num_gpus} GPUs x {gib(d.gpu_memory):.1f} GiB ({d.memory_utilization:.0%} usable), "
             f"attention {d.attention}; "
             f"weights {d.weight_dtype}, experts {d.expert_dtype or d.weight_dtype}, KV {d.kv_dtype}; "
             f"context {d.context:,} tokens"]
    rows = [("KV cache per token", f"{rep.kv_bytes_per_token:,} B ({_fmt_bytes(rep.kv_bytes_per_token)})"),
            ("KV per sequence per GPU", _fmt_bytes(rep.kv_bytes_per_sequence_per_gpu))]
    if m.is_moe:
        rows += [("bytes per expert (1 layer)", f"{rep.bytes_per_expert:,} B ({_fmt_bytes(rep.bytes_per_expert)})"),
                 (f"one slot per GPU ({m.num_moe_layers} layers)", _fmt_bytes(rep.bytes_per_slot))]
    rows += [("usable per GPU", _fmt_bytes(rep.usable_bytes)),
             ("non-expert weights per GPU", _fmt_bytes(rep.dense_bytes_per_gpu))]
    if m.is_moe:
        slots = rep.slots_per_gpu if rep.slots_per_gpu is not None else rep.base_slots_per_gpu
        rows.append((f"expert weights per GPU ({slots} slots)", _fmt_bytes(rep.expert_bytes_per_gpu)))
    rows += [(f"KV cache per GPU ({rep.concurrency:,} sequences)", _fmt_bytes(rep.kv_bytes_per_gpu)),
             ("free per GPU", _fmt_bytes(rep.free_bytes_per_gpu))]
    width = max(len(k) for k, _ in rows)
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    if m.is_moe:
        if rep.redundant_per_gpu is None:
            lines.append(f"does NOT fit: {_fmt_bytes(-rep.free_bytes_per_gpu)} short per GPU even with no "
                         f"redundant experts; lower concurrency or context, or add GPUs")
        else:
            lines.append(f"redundant slots: {rep.redundant_per_gpu} per GPU = {rep.slots_per_gpu} slots per GPU, "
                         f"{rep.redundant_total} redundant in total "
                         f"({d.num_gpus * rep.slots_per_gpu} physical slots for {m.num_logical_experts} experts)")
        if rep.tradeoff:
            lines.append("redundant/GPU -> most sequences that fit: "
                         + ", ".join(f"{r} -> {c:,}" for r, c in rep.tradeoff))
    elif not rep.fits:
        lines.append(f"does NOT fit: {_fmt_bytes(-rep.free_bytes_per_gpu)} short per GPU")
    if m.is_moe or rep.fits:
        lines.append(f"sequences: {rep.concurrency:,} x {d.context:,} tokens"
                     + ("" if rep.fits else " (does not fit)"))
    return "\n".join(lines)


def add_parser(sub) -> argparse.ArgumentParser:
    p = add_command(sub, "capacity", "memory per GPU: KV cache vs redundant expert slots",
                    "eplb capacity --model deepseek-v3 --gpus 32 --gpu-memory h200 --context 8192 --concurrency 2048")
    p.add_argument("--gpus", "-g", type=int, required=True, help="GPUs the model is spread over")
    p.add_argument("--redundant", type=int,
                   help="redundant slots in total (P - E); report the concurrency this leaves")
    add_arguments(p)
    nums = p.add_argument_group("explicit model numbers (override the preset, or describe a model without one)")
    for opt, fld in NUMBERS.items():
        nums.add_argument(f"--{opt.replace('_', '-')}", type=int, dest=f"n_{opt}", metavar="N", help=fld)
    add_output_flags(p)
    return p


def model_from_args(args) -> ModelShape:
    numbers = {fld: getattr(args, f"n_{opt}") for opt, fld in NUMBERS.items()}
    if args.model:
        return with_overrides(get_model(args.model), **numbers)
    need = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "head_dim")
    missing = [f"--{o.replace('_', '-')}" for o, f in NUMBERS.items() if f in need and numbers[f] is None]
    if missing:
        raise EplbError(f"give --model (one of the presets) or the model numbers; missing {', '.join(missing)}")
    given = {k: v for k, v in numbers.items() if v is not None}
    given.setdefault("num_kv_heads", given["num_attention_heads"])
    given.setdefault("intermediate_size", 0)
    return ModelShape("custom", **given)


def run(args) -> int:
    model = model_from_args(args)
    dep = deployment_from_args(args, args.gpus)
    per_gpu = None
    if args.redundant is not None:
        if not model.is_moe:
            raise EplbError(f"{model.name} is a dense model: --redundant does not apply")
        # Same rule as `eplb plan`: E + redundant must split evenly over the GPUs.
        topo = Topology.for_experts(model.num_logical_experts, num_gpus=args.gpus, num_redundant=args.redundant)
        per_gpu = topo.slots_per_gpu - -(-model.num_logical_experts // args.gpus)
    rep = plan_capacity(model, dep, redundant_per_gpu=per_gpu)
    if args.json:
        print_json(rep.to_dict())
    elif not args.quiet:
        print(format_report(rep))
    return 0
