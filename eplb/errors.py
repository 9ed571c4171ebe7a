"""Project errors.

`EplbError` is raised for bad user input (a file, a shape, an option that does not fit) and
carries a one-line message that names the value and the fix. The CLI turns it into exit
code 2. Internal invariants use `assert`; they are bugs, not user errors.
"""


import numpy as np


class EplbError(ValueError):
    """Bad input: the message names the offending value and how to fix it."""


def is_whole(v) -> bool:
    """int-like (2, 2.0, np.int64(2)): not True, "2", 2.5 or inf. int() would truncate 2.5
    silently, so every count, id and size of user input goes through this first."""
    if isinstance(v, (bool, np.bool_)):
        return False
    if isinstance(v, (int, np.integer)):
        return True
    return isinstance(v, (float, np.floating)) and float(v).is_integer()


def whole_number(name: str, v, minimum: int = 0) -> int:
    """v as an int if it is a whole number >= minimum, else EplbError naming name and v."""
    if not is_whole(v) or v < minimum:
        raise EplbError(f"{name} must be a whole number >= {minimum}, got {v!r}")
    return int(v)


class PlanningError(RuntimeError):
    """A planner could not produce a placement for valid input (CLI exit code 1)."""
