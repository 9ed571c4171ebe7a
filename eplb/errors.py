"""Project errors.

`EplbError` is raised for bad user input (a file, a shape, an option that does not fit) and
carries a one-line message that names the value and the fix. The CLI turns it into exit
code 2. Internal invariants use `assert`; they are bugs, not user errors.
"""


class EplbError(ValueError):
    """Bad input: the message names the offending value and how to fix it."""


class PlanningError(RuntimeError):
    """A planner could not produce a placement for valid input (CLI exit code 1)."""
