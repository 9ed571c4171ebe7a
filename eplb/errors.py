"""Project errors, and the checkers every boundary uses.

`EplbError` is raised for bad user input (a file, a shape, an option that does not fit) and
carries a one-line message that names the value and the fix. The CLI turns it into exit
code 2. Internal invariants use `assert`; they are bugs, not user errors.

The checkers validate one value at a boundary (the CLI, a public entry point, a value's
constructor) and return it converted (int or float); internal calls trust what they are
handed. Each names the value in its message: `whole_number("num_gpus", 2.5, 1)` says
"num_gpus must be a whole number >= 1, got 2.5". Whole numbers are int-like values only:
int() would truncate 2.5 silently and float() would read "4", so both are refused.
"""

from __future__ import annotations

import math
import re
import reprlib

import numpy as np


class EplbError(ValueError):
    """Bad input: the message names the offending value and how to fix it.

    The message is one line by construction: a value echoed with !r (an array's or a tensor's
    repr spans lines) or a library's text quoted in it cannot break the line a CLI prints."""

    def __init__(self, message: object = "", *args: object) -> None:
        text = str(message)
        if "\n" in text or "\x1b" in text or _CONTROL.search(text):
            text = " ".join(_CONTROL.sub("", _ANSI.sub("", text)).split())
        super().__init__(text, *args)


class PlanningError(RuntimeError):
    """A planner could not produce a placement for valid input (CLI exit code 1)."""


_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-_]")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
MAX_REASON = 300
"""Longest library message quoted in an error (some embed the whole bad value)."""


def reason(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none), without
    terminal escapes (torch bolds words with them) and at most MAX_REASON characters: what a
    one-line error quotes from a library that failed."""
    text = _CONTROL.sub("", _ANSI.sub("", str(exc)[:10 * MAX_REASON]))
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return lines[0] if len(lines[0]) <= MAX_REASON else lines[0][:MAX_REASON] + "..."


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxdict = 2, 6, 6, 4
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 60, 60, 40


def shown(v) -> str:
    """A short repr of a user's value for a message: a list of 10**8 numbers shows its first
    few, never all of them (built without making the full repr)."""
    if isinstance(v, np.ndarray):
        return f"an array of shape {v.shape} and dtype {v.dtype}"
    if _is_tensor(v):
        return f"a {str(v.layout).removeprefix('torch.')} tensor of shape {tuple(v.shape)} and dtype {v.dtype}"
    return _SHOWN.repr(v)


def a_name(what: str, v, choices) -> str:
    """v if it is a name (text); anything else (a list, an array, None) is refused with the choices
    (a dict lookup of an unhashable value would raise TypeError, an array == "x" is ambiguous)."""
    if not isinstance(v, str):
        raise EplbError(f"{what} must be a name, one of {', '.join(choices)}; got {shown(v)}")
    return v


def settings_map(what: str, v) -> dict:
    """v as a dict of settings keyed by name: None is {}; a list, a number or text is refused."""
    if v is None:
        return {}
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise EplbError(f"{what} must be a dict of settings by name (or None), got {shown(v)}")
    return dict(v)


def name_tuple(what: str, v) -> tuple:
    """v as a tuple of entries: one name alone is a tuple of one; a list or tuple as it is; a number,
    None, a dict or an array is refused."""
    if isinstance(v, str):
        return (v,)
    if not isinstance(v, (list, tuple)):
        raise EplbError(f"{what} must be a list of names, got {shown(v)}")
    return tuple(v)


def is_number(v) -> bool:
    """A real number (int, float or their numpy kinds): not True, "2" or None."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def is_whole(v) -> bool:
    """int-like (2, 2.0, np.int64(2)): not True, "2", 2.5 or inf."""
    if isinstance(v, (bool, np.bool_)):
        return False
    if isinstance(v, (int, np.integer)):
        return True
    return isinstance(v, (float, np.floating)) and float(v).is_integer()


def whole_number(name: str, v, minimum: int | None = 0) -> int:
    """v as an int if it is a whole number >= minimum (any whole number when minimum is None)."""
    if not is_whole(v) or (minimum is not None and v < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise EplbError(f"{name} must be a whole number{bound}, got {shown(v)}")
    return int(v)


def positive_integer(name: str, v) -> int:
    """v as an int if it is a whole number >= 1 (a count: GPUs, slots, bytes)."""
    if not is_whole(v) or v < 1:
        raise EplbError(f"{name} must be a positive integer, got {shown(v)}")
    return int(v)


def finite_number(name: str, v, minimum: float | None = None) -> float:
    """v as a float if it is a finite number >= minimum (any finite number when None)."""
    if not is_number(v) or not math.isfinite(v) or (minimum is not None and v < minimum):
        bound = "" if minimum is None else f" >= {minimum:g}"
        raise EplbError(f"{name} must be a finite number{bound}, got {shown(v)}")
    return float(v)


def positive_number(name: str, v) -> float:
    """v as a float if it is a finite number > 0 (a time, a scale)."""
    if not is_number(v) or not math.isfinite(v) or v <= 0:
        raise EplbError(f"{name} must be a positive number, got {shown(v)}")
    return float(v)


def fraction(name: str, v, *, low_open: bool = True, high_open: bool = False) -> float:
    """v as a float if it is a number in the interval from 0 to 1, (0, 1] by default;
    low_open / high_open say whether 0 / 1 are excluded."""
    ok = is_number(v) and (0.0 < v if low_open else 0.0 <= v) and (v < 1.0 if high_open else v <= 1.0)
    if not ok:
        interval = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"
        raise EplbError(f"{name} must be a number in {interval}, got {shown(v)}")
    return float(v)


def seed_value(name: str, v) -> int:
    """v as an int if it is a whole number in 0..2**63 - 1, what every seed eplb passes to numpy
    (np.random.default_rng refuses negative seeds) and Python's random accept."""
    if not is_whole(v) or not 0 <= v < 2**63:
        raise EplbError(f"{name} must be a whole number in 0..2**63-1, got {shown(v)}")
    return int(v)


def readonly(a: np.ndarray) -> np.ndarray:
    """a as a C-ordered array that cannot be written (what frozen values hold)."""
    a = np.ascontiguousarray(a)
    a.setflags(write=False)
    return a


def _holds_bool(v) -> bool:
    """True if nested lists / tuples `v` hold True or False anywhere (numpy would read them as 1, 0)."""
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, (bool, np.bool_)):
            return True
        if isinstance(x, (list, tuple)):
            kinds = set(map(type, x))
            if bool in kinds or np.bool_ in kinds:
                return True
            if list in kinds or tuple in kinds:
                stack.extend(y for y in x if isinstance(y, (list, tuple)))
    return False


def _is_tensor(v) -> bool:
    """A torch tensor, told without importing torch (this module sits below everything)."""
    return type(v).__module__.startswith("torch") and hasattr(v, "layout") and hasattr(v, "is_meta")


def tensor_array(name: str, t) -> np.ndarray:
    """A dense torch tensor's values as a numpy array, or an EplbError naming what it is instead.

    One contract for every tensor eplb reads (a .pt file, a serving engine's counts): meta
    tensors have no values, sparse or quantized ones no numpy form, complex ones no order;
    bfloat16 and float16 (no numpy twin, or a lossy one) become float64 exactly. bool stays bool
    for the caller to refuse by name. A reader of files sizes the tensor first (t.numel()): a
    stride-0 view claims any shape over one stored number."""
    import torch  # a tensor was given: torch is loaded already

    if t.is_meta:
        raise EplbError(f"{name} is a meta tensor (shape {tuple(t.shape)} and no data): give one that holds its values")
    if t.layout != torch.strided:
        raise EplbError(f"{name} is a {str(t.layout).removeprefix('torch.')} tensor: give a dense one "
                        f"(tensor.to_dense())")
    if t.is_quantized or t.is_complex():
        raise EplbError(f"{name} has dtype {t.dtype}: give integer or real counts")
    if t.dtype.is_floating_point and t.dtype.itemsize < 4:  # bfloat16, float16, float8: exact in float64
        t = t.to(torch.float64)
    try:
        return t.detach().cpu().resolve_conj().resolve_neg().numpy()
    except (TypeError, RuntimeError) as exc:  # dtypes numpy lacks (uint16 in old torch, float8, ...)
        raise EplbError(f"{name} has dtype {t.dtype}, which has no numpy form ({reason(exc)}): give int64 or "
                        f"float32 counts") from None


def number_array(name: str, v) -> np.ndarray:
    """v (an array, a torch tensor, or nested lists of numbers as JSON gives them) as a numeric
    ndarray, unchanged.

    Ragged lists, strings, null and true/false are refused by name: np.asarray would read
    [1, true] as [1, 1] and "2" as text, and fail on ragged lists with a bare ValueError.
    """
    if _is_tensor(v):
        v = tensor_array(name, v)
    if not isinstance(v, np.ndarray):
        if _holds_bool(v):
            raise EplbError(f"{name} must be numbers, not true/false")
        try:
            v = np.asarray(v)
        except (ValueError, TypeError, OverflowError) as exc:
            raise EplbError(f"{name} must be a rectangular array of numbers ({reason(exc)})") from None
    if v.dtype.kind == "b":
        raise EplbError(f"{name} must be numbers, not true/false")
    if v.dtype.kind not in "iuf":
        got = ("ragged lists or values that are not numbers (text, null, integers beyond 64 bits)"
               if v.dtype.kind == "O" else f"dtype {v.dtype}")
        raise EplbError(f"{name} must be a rectangular array of numbers, got {got}")
    return v


def whole_array(name: str, v) -> np.ndarray:
    """v as an int64 ndarray if it holds whole numbers only (ids, counts): 2.7, NaN, inf and
    values beyond +-2**62 are refused by name (astype(int64) would truncate or wrap them)."""
    a = number_array(name, v)
    if a.dtype.kind == "f":
        bad = ~np.isfinite(a) | (a != np.rint(a)) | (np.abs(a) > 2.0**62)
        if bad.any():
            raise EplbError(f"{name} must be whole numbers (integers), got {a[bad].flat[0].item()!r}")
    elif a.dtype.kind == "u" and a.size and a.max() > 2**62:
        raise EplbError(f"{name} must be whole numbers up to 2**62, got {a.max()}")
    return a.astype(np.int64)
