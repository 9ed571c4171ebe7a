"""TensorRT-LLM: check a `load_balancer` YAML against a deployment (static placement only).

Legend: L = MoE layers, E = logical experts, G = EP ranks, P = slots (`num_slots`).

TensorRT-LLM has no Python policy hook: its load balancer takes a static placement from the
YAML given as `moe_config.load_balancer` (`MoeLoadBalancerConfig`: `num_slots`,
`initial_global_assignments` keyed by MoE layer index, `layer_updates_per_iter: 0`) or moves
experts online with its own C++ algorithm. It routes an expert's tokens round-robin over its
replicas (`moeComputeRouteKernel`), an even split (eplb.dispatch.ENGINES["trtllm"]), so
`eplb plan --engine trtllm` plans for that. What TensorRT-LLM checks of the file is little
(num_slots divisible by the EP size); `check_load_balancer` checks what a wrong file breaks:
slots per layer, expert ids, every expert placed, and the MoE layer ids of the model.
With TensorRT-LLM installed, `check_with_trtllm` also reads the file with its own config class
on every rank.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eplb.core.files import parse_yaml, read_bytes
from eplb.core.placement import Placement
from eplb.errors import EplbError
from eplb.formats.trtllm import read_trtllm
from eplb.integrations import check_version

SUPPORTED_VERSIONS = ("1.2.1",)
ENV_ANY_VERSION = "EPLB_TRTLLM_ANY_VERSION"


def check_load_balancer(path: str | Path, *, num_experts: int, ep_size: int, moe_layer_ids=None):
    """The file's Placement, or EplbError naming what does not fit the deployment (both numbers).

    moe_layer_ids: the model's MoE layer indices (DeepSeek-V3: 3..60); None skips that check.
    """
    path = Path(path)
    p = read_trtllm(path, num_gpus=1, num_logical_experts=num_experts)
    d = parse_yaml(read_bytes(path, "TensorRT-LLM load-balancer file"), str(path))  # read_trtllm checked it
    num_slots = d.get("num_slots")
    if num_slots is not None and int(num_slots) != p.num_slots:
        raise EplbError(f"{path}: num_slots is {num_slots}, but the layers list {p.num_slots} slots each")
    if p.num_slots % ep_size:
        raise EplbError(f"{path}: {p.num_slots} slots do not split over the EP size {ep_size}: plan with "
                        f"--gpus {ep_size} and a slot count that is a multiple of it")
    if moe_layer_ids is not None:
        want = sorted(int(i) for i in moe_layer_ids)
        have = p.layer_ids.tolist()
        if have != want:
            missing = sorted(set(want) - set(have))
            extra = sorted(set(have) - set(want))
            raise EplbError(f"{path}: the file lists {len(have)} MoE layers, the model has {len(want)}"
                            + (f"; missing {missing[:8]}" if missing else "")
                            + (f"; not MoE layers {extra[:8]}" if extra else ""))
    return Placement(p.phy2log_LP, ep_size, num_experts, 1, p.layer_ids, planner="trtllm")


def check_with_trtllm(path: str | Path, *, ep_size: int) -> np.ndarray:
    """Read the file with TensorRT-LLM's own `MoeLoadBalancerConfig` on every rank; returns the
    slots each rank loads, int64 [G, L, P // G] (layers in the file's order)."""
    import tensorrt_llm
    from tensorrt_llm.llmapi.llm_args import MoeLoadBalancerConfig

    check_version("TensorRT-LLM", tensorrt_llm.__version__, SUPPORTED_VERSIONS, ENV_ANY_VERSION)
    d = parse_yaml(read_bytes(path, "TensorRT-LLM load-balancer file"), str(path))
    layers = sorted(int(k) for k in d["initial_global_assignments"])
    out = []
    for rank in range(ep_size):
        cfg = MoeLoadBalancerConfig(**d)
        cfg.setup(ep_rank=rank, ep_size=ep_size)
        out.append([cfg.get_layer_initial_global_assignments(layer)[cfg.slot_start:cfg.slot_end] for layer in layers])
    return np.asarray(out, dtype=np.int64)
