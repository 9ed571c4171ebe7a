"""One front door for placement files: write or read a Placement in an engine's format.

Formats (`--format`):
- "eplb":   native JSON (eplb.formats.native: `save_placement` / `load_placement`), lossless
- "sglang": `--init-expert-location` JSON, rows for every hidden layer (eplb.formats.sglang)
- "vllm":   `.pt` dict of vLLM's three EPLB tensors (eplb.formats.vllm; needs torch)
- "trtllm": TensorRT-LLM `load_balancer` YAML (eplb.formats.trtllm)
DeepSeek's `(phy2log, log2phy, logcnt)` tuple is an API, not a file: eplb.formats.deepseek.

Engine formats carry less than eplb's own file (no dispatch weights, planner or metrics; SGLang
and TensorRT-LLM files carry no GPU count), so reading them back asks for what is missing.
"""

from __future__ import annotations

from pathlib import Path

from eplb.core.files import as_path
from eplb.core.placement import Placement
from eplb.errors import EplbError
from eplb.formats.native import load_placement, save_placement
from eplb.formats.sglang import read_sglang, write_sglang
from eplb.formats.trtllm import read_trtllm, write_trtllm
from eplb.formats.vllm import read_vllm, write_vllm

FORMATS = ("eplb", "sglang", "vllm", "trtllm")
EXTENSIONS = {"eplb": (".json",), "sglang": (".json",), "vllm": (".pt", ".pth"), "trtllm": (".yaml", ".yml")}
"""File name endings each format is written under; other endings are not checked."""


def _check(fmt: str) -> str:
    if fmt not in FORMATS:
        raise EplbError(f"unknown placement format {fmt!r}: choose one of {', '.join(FORMATS)}")
    return fmt


def formats_for_name(path: str | Path, fmt: str) -> tuple[str, ...]:
    """The formats a file name's ending says, when it says another than `fmt` (plan.yaml for
    "eplb" gives ("trtllm",)); () when the ending fits `fmt` or belongs to no format."""
    ext = Path(path).suffix.lower()
    if ext in EXTENSIONS[_check(fmt)]:
        return ()
    return tuple(f for f, exts in EXTENSIONS.items() if ext in exts)


def check_name(path: str | Path, fmt: str) -> None:
    """Refuse a file name whose ending says another format: a zip named .json, or JSON named
    .yaml, fools every tool that trusts the name (the CLI's -o also refuses endings no format
    has, like .txt: eplb.commands.common.check_suffix)."""
    path = Path(path)
    others = formats_for_name(path, fmt)
    if others:
        raise EplbError(f"{path}: the name ends in {path.suffix}, which is for {' or '.join(others)} files, but the "
                        f"format is {fmt}: name it {' or '.join(EXTENSIONS[fmt])}, or write format "
                        f"{' or '.join(others)}")


def write_placement(placement: Placement, path: str | Path, fmt: str = "eplb", *,
                    num_hidden_layers: int | None = None) -> Path:
    """Write `placement` to `path` in format `fmt`.

    num_hidden_layers: rows of the SGLang map (dense + MoE layers); default the largest MoE
    layer id + 1, which is right whenever the model ends with a MoE layer (DeepSeek-V3: 61).
    """
    if not isinstance(placement, Placement):
        raise EplbError(f"write_placement needs an eplb Placement, got {type(placement).__name__}")
    path = as_path(path, "the placement's path")
    check_name(path, fmt)
    too_few = num_hidden_layers is not None and num_hidden_layers <= int(placement.layer_ids.max())
    if _check(fmt) != "sglang" and too_few:
        raise EplbError(f"num_hidden_layers ({num_hidden_layers}) must exceed the largest MoE layer id")
    if fmt == "eplb":
        save_placement(placement, path)
    elif fmt == "sglang":
        write_sglang(placement, path, num_hidden_layers)
    elif fmt == "vllm":
        write_vllm(placement, path)
    else:
        write_trtllm(placement, path)
    return path


def read_placement(path: str | Path, fmt: str = "eplb", *, num_gpus: int | None = None,
                   num_nodes: int | None = None, num_logical_experts: int | None = None,
                   layer_ids=None) -> Placement:
    """Read a placement file written in format `fmt`.

    num_gpus is required for "sglang" and "trtllm" (their files do not record it);
    layer_ids picks the MoE rows of an SGLang map (default: every row, ids 0..H-1).
    """
    if _check(fmt) == "eplb":
        return load_placement(path)
    if fmt == "vllm":
        return read_vllm(path, num_gpus=num_gpus, num_nodes=num_nodes, layer_ids=layer_ids)
    if num_gpus is None:
        raise EplbError(f"reading a {fmt} placement needs num_gpus (the file does not record the GPU count)")
    if fmt == "sglang":
        return read_sglang(path, num_gpus=num_gpus, layer_ids=layer_ids,
                           num_logical_experts=num_logical_experts, num_nodes=num_nodes or 1)
    return read_trtllm(path, num_gpus=num_gpus, num_logical_experts=num_logical_experts, num_nodes=num_nodes or 1)
