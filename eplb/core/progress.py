"""Progress bars for long work (ILP over many layers, backtests): shown on a terminal only.

A bar goes to stderr when stderr is a TTY and the caller did not ask for quiet; piped or
`--quiet` output stays clean. No dependency: one carriage-return line, redrawn at most
10 times a second.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar

T = TypeVar("T")


class Progress:
    """A minimal progress bar: `with Progress(total, "ilp") as bar: ... bar.update()`."""

    def __init__(self, total: int | None, desc: str = "", *, enabled: bool | None = None,
                 stream: TextIO | None = None, min_interval: float = 0.1):
        self.total = total
        self.desc = desc
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = (hasattr(self.stream, "isatty") and self.stream.isatty()) if enabled is None else enabled
        self.count = 0
        self.min_interval = min_interval
        self._start = time.perf_counter()
        self._last = 0.0

    def update(self, n: int = 1) -> None:
        self.count += n
        now = time.perf_counter()
        if self.enabled and (now - self._last >= self.min_interval or self.count == self.total):
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = now - self._start
        if self.total:
            frac = min(self.count / self.total, 1.0)
            bar = "#" * int(frac * 30)
            eta = elapsed / frac - elapsed if frac > 0 else 0.0
            line = f"\r{self.desc} [{bar:<30}] {self.count}/{self.total} {elapsed:.1f}s eta {eta:.1f}s"
        else:
            line = f"\r{self.desc} {self.count} {elapsed:.1f}s"
        self.stream.write(line)
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(items: Iterable[T], total: int | None = None, desc: str = "", *,
             enabled: bool | None = None) -> Iterator[T]:
    """Iterate over items with a progress bar on a terminal (enabled=False to silence)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(total, desc, enabled=enabled) as bar:
        for item in items:
            yield item
            bar.update()


class Notice:
    """One status line on a terminal while slow work runs: `with Notice("planning ...")`.

    Written to stderr after `after` seconds (quick work prints nothing), with the time
    elapsed redrawn about once a second, and erased when the work ends. Nothing when stderr
    is not a TTY or `enabled` is False.
    """

    def __init__(self, message: str, *, after: float = 1.0, enabled: bool | None = None,
                 stream: TextIO | None = None):
        self.message = message
        self.after = after
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = (hasattr(self.stream, "isatty") and self.stream.isatty()) if enabled is None else enabled
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True) if self.enabled else None
        self._shown = False

    def _run(self) -> None:
        start = time.perf_counter()
        if self._done.wait(self.after):
            return
        while not self._done.is_set():
            self.stream.write(f"\r{self.message} {time.perf_counter() - start:.0f}s")
            self.stream.flush()
            self._shown = True
            self._done.wait(1.0)

    def __enter__(self) -> Notice:
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is None:
            return
        self._done.set()
        self._thread.join()
        if self._shown:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
