"""Torch side of eplb: the reference model (model.py) and the expert-parallel shim.

torch is imported here (and only under eplb.runtime and eplb.runtime.collect); nothing in the
planning path or the CLI's start-up imports this package.
"""

from eplb.runtime.config import ModelConfig
from eplb.runtime.model import DeepSeekModel, MLAttention, MoE, Router

__all__ = ["DeepSeekModel", "MLAttention", "ModelConfig", "MoE", "Router"]
