"""What every fuzz test checks: only success, or one EplbError line naming the problem.

`examples(n)`: n examples under the default ("ci") profile, scaled with the profile given by
`--hypothesis-profile` (long: 30 x n). `outcome(call, names)` runs one call and records
"ok" or "refused" as a Hypothesis event (`--hypothesis-show-statistics` prints the split);
any other exception fails the test with its traceback.
"""

from __future__ import annotations

import warnings

from hypothesis import event, settings

from eplb.errors import EplbError


def examples(n: int) -> int:
    """n examples at the ci profile's 100 per test; proportionally more under a longer profile."""
    return max(1, n * settings.default.max_examples // 100)


def check_message(msg: str, names=()) -> None:
    """An EplbError message: one non-empty line, naming one of `names` (file names) if given."""
    assert msg and "\n" not in msg and "Traceback" not in msg, repr(msg)
    if names:
        assert any(n in msg for n in names), f"message names none of {list(names)}: {msg}"


def outcome(call, names=()):
    """Run call(); 'ok' with its result, or 'refused' after checking the EplbError message.
    Either way no warning may be raised (a CLI user would see it as lines of noise)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = call()
        except EplbError as exc:
            check_message(str(exc), names)
            kind, result = "refused", exc
        else:
            kind = "ok"
    noisy = [f"{w.category.__name__}: {w.message}" for w in caught
             if issubclass(w.category, (RuntimeWarning, UserWarning))]
    assert not noisy, noisy
    event(kind)
    return kind, result
