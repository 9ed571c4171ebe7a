"""Topology: how many GPUs (ranks), nodes and physical slots a placement spreads over.

Legend: G = GPUs (ranks), N = nodes, S = slots per GPU, P = G * S physical slots.
Slot p lives on GPU p // S; GPU g lives on node g // (G // N), as in every serving engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.errors import EplbError, is_whole


@dataclass(frozen=True)
class Topology:
    """The expert-parallel group a placement is made for."""

    gpus: int
    """G: number of expert-parallel ranks (GPUs)."""
    slots_per_gpu: int
    """S: physical expert slots on each GPU (logical experts / G plus redundant ones)."""
    nodes: int = 1
    """N: number of nodes; GPUs are split evenly and contiguously over nodes."""

    def __post_init__(self) -> None:
        for name in ("gpus", "slots_per_gpu", "nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise EplbError(f"{name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.gpus % self.nodes:
            raise EplbError(
                f"gpus ({self.gpus}) must be divisible by nodes ({self.nodes}): "
                f"every node holds the same number of GPUs"
            )

    @classmethod
    def for_experts(
        cls,
        num_experts: int,
        *,
        gpus: int,
        nodes: int = 1,
        redundant: int | None = None,
        slots_per_gpu: int | None = None,
    ) -> "Topology":
        """Size a topology for E logical experts.

        Give either `redundant` (extra slots in total, P - E) or `slots_per_gpu`. With neither,
        one redundant slot per GPU is added (P = E rounded up to a multiple of G, plus G), but
        never more than E slots per GPU: a GPU that already holds every expert has no use for a
        second copy of one (so a single GPU gets no redundant slot).
        """
        # Whole numbers only: int() would read 2.5 GPUs as 2 and "4" as 4. (A negative
        # redundant count and too few slots get their own messages below.)
        for name, value, low in (("gpus", gpus, 1), ("redundant", redundant, None),
                                 ("slots_per_gpu", slots_per_gpu, None)):
            if value is None and name != "gpus":
                continue
            if not is_whole(value) or (low is not None and value < low):
                raise EplbError(f"{name} must be a {'positive integer' if low else 'whole number'}, got {value!r}")
        gpus = int(gpus)
        if redundant is not None and slots_per_gpu is not None:
            raise EplbError(
                f"give either redundant ({redundant}) or slots_per_gpu ({slots_per_gpu}), not both"
            )
        if slots_per_gpu is not None:
            slots = int(slots_per_gpu)
            if slots * gpus < num_experts:
                raise EplbError(
                    f"slots_per_gpu ({slots}) x gpus ({gpus}) = {slots * gpus} slots cannot hold "
                    f"{num_experts} logical experts: use at least "
                    f"{-(-num_experts // gpus)} slots per GPU"
                )
        else:
            if redundant is None:
                slots = min(-(-num_experts // gpus) + 1, max(int(num_experts), 1))
            else:
                redundant = int(redundant)
                if redundant < 0:
                    raise EplbError(f"redundant must be >= 0, got {redundant}")
                total = num_experts + redundant
                if total % gpus:
                    below = redundant - total % gpus
                    hint = f"{below} or {below + gpus}" if below >= 0 else f"{below + gpus}"
                    raise EplbError(
                        f"{num_experts} experts + {redundant} redundant = {total} slots do not "
                        f"split evenly over {gpus} GPUs: use redundant = {hint}"
                    )
                slots = total // gpus
        if gpus > slots * gpus:
            raise EplbError(f"more GPUs ({gpus}) than physical slots ({slots * gpus})")
        return cls(gpus=gpus, slots_per_gpu=slots, nodes=nodes)

    @property
    def num_slots(self) -> int:
        """P: physical slots in total."""
        return self.gpus * self.slots_per_gpu

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes

    def gpu_of_slot(self) -> np.ndarray:
        """gpu_P: the GPU each physical slot lives on."""
        return np.arange(self.num_slots) // self.slots_per_gpu

    def node_of_gpu(self) -> np.ndarray:
        """node_G: the node each GPU lives on."""
        return np.arange(self.gpus) // self.gpus_per_node
