"""Topology: how many GPUs (ranks), nodes and physical slots a placement spreads over.

Legend: G = GPUs (ranks), N = nodes, S = slots per GPU, P = G * S physical slots.
Slot p lives on GPU p // S; GPU g lives on node g // (G // N), as in every serving engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.errors import EplbError, positive_integer, whole_number


@dataclass(frozen=True)
class Topology:
    """The expert-parallel group a placement is made for."""

    num_gpus: int
    """G: number of expert-parallel ranks (GPUs)."""
    slots_per_gpu: int
    """S: physical expert slots on each GPU (logical experts / G plus redundant ones)."""
    num_nodes: int = 1
    """N: number of nodes; GPUs are split evenly and contiguously over nodes."""

    def __post_init__(self) -> None:
        for name in ("num_gpus", "slots_per_gpu", "num_nodes"):
            object.__setattr__(self, name, positive_integer(name, getattr(self, name)))
        if self.num_gpus % self.num_nodes:
            raise EplbError(
                f"num_gpus ({self.num_gpus}) must be divisible by num_nodes ({self.num_nodes}): "
                f"every node holds the same number of GPUs"
            )

    @classmethod
    def for_experts(
        cls,
        num_logical_experts: int,
        *,
        num_gpus: int,
        num_nodes: int = 1,
        num_redundant: int | None = None,
        slots_per_gpu: int | None = None,
    ) -> Topology:
        """Size a topology for E logical experts.

        Give either `num_redundant` (extra slots in total, P - E) or `slots_per_gpu`. With neither,
        one redundant slot per GPU is added (P = E rounded up to a multiple of G, plus G), but
        never more than E slots per GPU: a GPU that already holds every expert has no use for a
        second copy of one (so a single GPU gets no redundant slot).
        """
        # A negative redundant count and too few slots get their own messages below.
        num_gpus = positive_integer("num_gpus", num_gpus)
        num_redundant = None if num_redundant is None else whole_number("num_redundant", num_redundant, None)
        slots_per_gpu = None if slots_per_gpu is None else whole_number("slots_per_gpu", slots_per_gpu, None)
        if num_redundant is not None and slots_per_gpu is not None:
            raise EplbError(
                f"give either num_redundant ({num_redundant}) or slots_per_gpu ({slots_per_gpu}), not both"
            )
        if slots_per_gpu is not None:
            slots = int(slots_per_gpu)
            if slots * num_gpus < num_logical_experts:
                raise EplbError(
                    f"slots_per_gpu ({slots}) x num_gpus ({num_gpus}) = {slots * num_gpus} slots cannot hold "
                    f"{num_logical_experts} logical experts: use at least "
                    f"{-(-num_logical_experts // num_gpus)} slots per GPU"
                )
        else:
            if num_redundant is None:
                slots = min(-(-num_logical_experts // num_gpus) + 1, max(int(num_logical_experts), 1))
            else:
                num_redundant = int(num_redundant)
                if num_redundant < 0:
                    raise EplbError(f"num_redundant must be >= 0, got {num_redundant}")
                total = num_logical_experts + num_redundant
                if total % num_gpus:
                    below = num_redundant - total % num_gpus
                    hint = f"{below} or {below + num_gpus}" if below >= 0 else f"{below + num_gpus}"
                    raise EplbError(
                        f"{num_logical_experts} experts + {num_redundant} redundant = {total} slots do not "
                        f"split evenly over {num_gpus} GPUs: use num_redundant = {hint}"
                    )
                slots = total // num_gpus
        if num_gpus > slots * num_gpus:
            raise EplbError(f"more GPUs ({num_gpus}) than physical slots ({slots * num_gpus})")
        return cls(num_gpus=num_gpus, slots_per_gpu=slots, num_nodes=num_nodes)

    @property
    def num_slots(self) -> int:
        """P: physical slots in total."""
        return self.num_gpus * self.slots_per_gpu

    @property
    def gpus_per_node(self) -> int:
        return self.num_gpus // self.num_nodes

    def gpu_of_slot(self) -> np.ndarray:
        """gpu_P: the GPU each physical slot lives on."""
        return np.arange(self.num_slots) // self.slots_per_gpu

    def node_of_gpu(self) -> np.ndarray:
        """node_G: the node each GPU lives on."""
        return np.arange(self.num_gpus) // self.gpus_per_node
