"""`eplb capacity`: how many redundant expert slots fit next to the KV cache on each GPU."""

from __future__ import annotations

import argparse

from eplb.commands.common import add_command, add_output_flags, print_json

# Explicit model numbers: option name -> ModelShape field.
NUMBERS = {
    "layers": "num_hidden_layers", "dense_layers": "num_dense_layers", "hidden": "hidden_size",
    "vocab": "vocab_size", "heads": "num_attention_heads", "kv_heads": "num_kv_heads",
    "head_dim": "head_dim", "intermediate": "intermediate_size", "experts": "num_logical_experts",
    "expert_intermediate": "moe_intermediate_size", "shared_experts": "num_shared_experts",
    "top_k": "top_k", "kv_lora_rank": "kv_lora_rank", "q_lora_rank": "q_lora_rank",
    "rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
}


def add_parser(sub) -> argparse.ArgumentParser:
    from eplb.capacity import add_arguments

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


def model_from_args(args):
    from eplb.capacity import ModelShape, get_model, with_overrides
    from eplb.errors import EplbError

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
    from eplb.capacity import deployment_from_args, format_report, plan_capacity
    from eplb.errors import EplbError
    from eplb.topology import Topology

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
