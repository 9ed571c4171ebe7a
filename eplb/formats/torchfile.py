"""torch `.pt` files, read one way: checked, weights only, every tensor through one contract.

`load_torch(path, what)`: the archive's declared size within the input limit and every
member's CRC-32 checked (eplb.core.files.check_archive; torch's own reader checks no CRC, so a
flipped byte in a tensor's data would load as another number), then
`torch.load(weights_only=True)`: tensors, numbers, strings and containers only, nothing that
runs code. `file_tensor(path, key, t)`: one tensor of such a file as a numpy array, sized
before it is copied and refused by name when it has no values (meta), no numpy form (sparse,
quantized, nested) or no order (complex): eplb.errors.tensor_array.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from eplb.core.files import TENSOR_BYTES, check_archive, check_input_size, input_file
from eplb.errors import EplbError, reason, tensor_array

_UNSAFE = re.compile(r"WeightsUnpickler error: ([^\n]*?)(?: was not an allowed global.*)?$", re.MULTILINE)


def load_torch(path: str | Path, what: str) -> Any:
    """What a torch `.pt` file holds, loaded weights-only after its size and CRCs are checked."""
    import torch  # only the .pt readers need torch

    path = input_file(path, what)
    check_archive(path, f"the torch file ({what})")
    try:
        with warnings.catch_warnings():  # a damaged file's pickle protocol warning is noise: it is refused
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for unsafe or corrupt files
        raise torch_load_error(path, exc) from None


def torch_load_error(source, exc: BaseException) -> EplbError:
    """The one-line error for a torch.load that failed: the object a weights-only load refused
    by name (torch's own message is a paragraph of advice to load unsafely)."""
    unsafe = _UNSAFE.search(str(exc))
    if unsafe:
        return EplbError(f"{source}: holds Python objects a weights-only load refuses ({unsafe.group(1).strip()}): "
                         f"eplb never unpickles them (pickle can run code); save plain tensors, numbers, lists "
                         f"and dicts")
    return EplbError(f"{source}: cannot load as a weights-only torch file ({type(exc).__name__}: {reason(exc)})")


def file_tensor(path, key: str, t) -> np.ndarray:
    """Tensor `key` of the file `path` as a numpy array (bfloat16 and float16 as float64), sized
    against the input limit (TENSOR_BYTES an element) before it is copied."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise EplbError(f"{path}: {key} must be a tensor, got {type(t).__name__}")
    if t.is_nested:
        raise EplbError(f"{path}: {key} is a nested tensor: give a dense one")
    # A stride-0 view can claim any shape over one stored number: sized before it is copied.
    check_input_size(path, t.numel() * TENSOR_BYTES, f"reading {key} (shape {tuple(t.shape)})")
    return tensor_array(f"{path}: {key}", t)
