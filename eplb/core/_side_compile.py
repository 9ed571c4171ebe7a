"""Side processes that compile kernels into numba's cache while their caller goes on.

`eplb.core.jit` hands a kernel and its argument types to `SIDE.request`; a daemon thread
gathers the requests a call sequence makes (`GATHER_S`), starts one Python process for the
batch (`main`, reading JSON requests on stdin) and marks each kernel "compiled" or "failed:
reason" (`Kernel._finished`) as the process reports it on stdout. Processes asking for the
same kernel, types and cache take turns through a file lock, so an engine's workers starting
together compile it once. Argument types travel as JSON (`type_spec`, `from_spec`).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager

import numpy as np

MODE_ENV = "EPLB_JIT"
SIDE_TIMEOUT_S = 1800.0
"""A side process still compiling after this long is killed (its kernels stay interpreted)."""


def type_spec(t) -> list:
    """A numba argument type as JSON (what a side process rebuilds it from)."""
    from numba.core import types

    if isinstance(t, types.Array):
        return ["array", str(np.dtype(t.dtype.name)), t.ndim, t.layout, not t.mutable]
    if isinstance(t, types.BaseTuple):
        return ["tuple", [type_spec(x) for x in t.types]]
    if isinstance(t, (types.Integer, types.Float, types.Boolean)):
        return ["scalar", str(np.dtype(t.name if not isinstance(t, types.Boolean) else "bool"))]
    if t == types.none:
        return ["none"]
    raise TypeError(f"a kernel argument of numba type {t} cannot be sent to a side process")


def from_spec(spec):
    import numba
    from numba.core import types

    kind = spec[0]
    if kind == "array":
        _, dtype, ndim, layout, readonly = spec
        return types.Array(numba.from_dtype(np.dtype(dtype)), ndim, layout, readonly=readonly)
    if kind == "tuple":
        return types.BaseTuple.from_types([from_spec(x) for x in spec[1]])
    if kind == "scalar":
        return numba.from_dtype(np.dtype(spec[1]))
    return types.none


class _SideCompiles:
    """The queue of compile requests, run in batches by side processes that daemon threads start."""

    GATHER_S = 0.3
    """A worker waits this long after a request for the others a call sequence makes: one side
    process then compiles them all, and compiles the kernels they share once."""

    def __init__(self):
        self._queue: list = []
        self._busy = 0
        self._cv = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._workers = 2 if (os.cpu_count() or 1) > 4 else 1

    def request(self, k, sig) -> None:
        try:
            spec = [type_spec(t) for t in sig]
        except TypeError as exc:
            k._state[sig] = f"failed: {exc}"
            return
        with self._cv:
            self._queue.append((k, sig, spec))
            if len(self._threads) < self._workers:
                t = threading.Thread(target=self._work, name="eplb-jit-side-compile", daemon=True)
                self._threads.append(t)
                t.start()
            self._cv.notify()

    def idle(self, timeout: float | None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout)

    def _work(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue)
                self._busy += 1
            try:
                threading.Event().wait(self.GATHER_S)
                with self._cv:
                    batch, self._queue = self._queue, []
                _compile_aside(batch)
            finally:
                with self._cv:
                    self._busy -= 1
                    self._cv.notify_all()


SIDE = _SideCompiles()


def _compile_aside(batch: list) -> None:
    """Compile the batch's (kernel, types) in one side process, in order; each kernel's state
    turns "compiled" or "failed: reason" as the side process reports it."""
    requests = [{"module": k.py_func.__module__, "name": k.py_func.__qualname__, "signature": spec}
                for k, _, spec in batch]
    # The side process imports the same eplb (sys.path may have been extended at run time).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), **{MODE_ENV: "wait"})
    done = [False] * len(batch)
    try:
        proc = subprocess.Popen([sys.executable, "-c", "from eplb.core._side_compile import main; main()"],
                                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)   # not stopped by the caller's Ctrl-C, nor its exit
    except OSError as exc:  # no subprocesses here (a sandbox): the kernels stay interpreted
        for k, sig, _ in batch:
            k._finished(sig, f"failed: cannot start a side process ({exc})")
        return
    timer = threading.Timer(SIDE_TIMEOUT_S, proc.kill)
    timer.start()
    try:
        proc.stdin.write(json.dumps(requests).encode())
        proc.stdin.close()
        for line in proc.stdout:          # "<i> compiled" or "<i> failed: reason", one per request
            i, _, state = line.decode(errors="replace").strip().partition(" ")
            k, sig, _ = batch[int(i)]
            k._finished(sig, state)
            done[int(i)] = True
        err = proc.stderr.read().decode(errors="replace").strip().splitlines()
        proc.wait()
    finally:
        timer.cancel()
    why = err[-1] if err else f"exit status {proc.returncode}"
    for (k, sig, _), ok in zip(batch, done):
        if not ok:
            k._finished(sig, f"failed: the side process ended ({why})")


def main() -> None:
    """A side process: compile each (kernel, types) read from stdin into numba's cache, saying
    so on stdout as each is done. Processes asking for the same kernel, types and cache take
    turns; a later one finds the machine code cached and only loads it. A caller that exits
    leaves this process to finish the list (the next run finds the cache warm)."""
    for i, request in enumerate(json.loads(sys.stdin.read())):
        try:
            module = importlib.import_module(request["module"])
            k = getattr(module, request["name"])
            sig = tuple(from_spec(s) for s in request["signature"])
            key = json.dumps([getattr(module, "__file__", ""), request, os.environ.get("NUMBA_CACHE_DIR", ""),
                              sys.version_info[:2]])
            path = os.path.join(tempfile.gettempdir(), f"eplb-jit-{hashlib.sha1(key.encode()).hexdigest()[:16]}.lock")
            with _turn(path):
                k.dispatcher.compile(sig)
            state = "compiled"
        except Exception as exc:  # reported to the caller, whose kernel stays interpreted
            state = "failed: " + " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
        try:
            print(i, state, flush=True)
        except OSError:  # the caller has exited: go on filling the cache for its next run
            pass


@contextmanager
def _turn(path: str):
    """Hold an exclusive lock on the file `path` (no lock where the system has none)."""
    try:
        import fcntl
    except ImportError:  # no POSIX file locks (Windows): compile without waiting for the others
        fcntl = None
    try:
        f = open(path, "a")
    except OSError:  # another user's lock file, a read-only temp folder
        f = None
    try:
        if fcntl is not None and f is not None:
            fcntl.flock(f, fcntl.LOCK_EX)   # released when the file closes, or the process ends
        yield
    finally:
        if f is not None:
            f.close()
