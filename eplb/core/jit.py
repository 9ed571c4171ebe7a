"""Compiled kernels without the wait: load them in the background, compile them in side processes.

eplb's hot loops are numba kernels (planners/_greedy_kernel.py, eplb/migration/_*_kernel.py)
compiled with `cache=True`: the first process after an install compiles them (tens of seconds
on a small machine), every later one loads the machine code from the cache (about a second,
numba's import included). Neither should hold up a serving process, so `warm_up_in_background`
runs on a daemon thread:
1. it loads every kernel in this process, refusing to compile (a numba compile event in that
   thread aborts the load): with a warm cache that is all;
2. on a cold cache it compiles in side processes, one per kernel module and all at once (no
   GIL shared with the serving threads here, and a machine with several cores compiles them
   in parallel), then loads their cache in this process.
`Warmup.wait()` blocks until the kernels are loaded; the Rebalancer calls it before its first
decision, and while `Warmup.compiling` its `observe` holds back a due check, so that a serving
loop that rebalances when told to never waits for a compile. A module named here is imported
by name (the caller's choice, like the planner table) and must define `warm_up()`, which runs
each of its kernels once on tiny inputs of the argument types the real calls use. Set
EPLB_COMPILE_IN_PROCESS=1 to compile in this process instead of in side processes (a sandbox
that forbids subprocesses).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

_SIDE_TIMEOUT_S = 1800.0
"""A side process still compiling after this long is given up on (the thread then compiles here)."""


class _ColdCache(Exception):
    """A kernel had no cached machine code (raised inside numba's compile event)."""


_probing: set[int] = set()
_listener_installed = False
_listener_lock = threading.Lock()


def _install_listener() -> None:
    """A numba compile-event listener that aborts compiles started by a probing thread."""
    global _listener_installed
    with _listener_lock:
        if _listener_installed:
            return
        from numba.core import event

        class _RefuseCompile(event.Listener):
            def on_start(self, ev):
                if threading.get_ident() in _probing:
                    raise _ColdCache(ev.data["dispatcher"].py_func.__qualname__)

            def on_end(self, ev):
                pass

        event.register("numba:compile", _RefuseCompile())
        _listener_installed = True


def _warm_up(modules: tuple[str, ...]) -> None:
    for name in modules:
        module, function = warm_up_target(name)
        getattr(importlib.import_module(module), function)()


def warm_up_target(name: str) -> tuple[str, str]:
    """(module, function) of a warm-up name: "module" runs module.warm_up(), "module:function"
    another function of it (a kernel only some clusters use, warmed only for them)."""
    module, _, function = name.partition(":")
    return module, function or "warm_up"


def load_cached(modules: tuple[str, ...]) -> bool:
    """Load the kernels of `modules` from numba's cache in this thread without compiling any;
    False when one is not cached yet (those before it stay loaded)."""
    _install_listener()
    me = threading.get_ident()
    _probing.add(me)
    try:
        _warm_up(modules)
        return True
    except _ColdCache:
        return False
    finally:
        _probing.discard(me)


def compile_once(name: str) -> None:
    """Run the warm-up `name` (compiling its kernels into numba's cache), one process at a time
    per warm-up and cache: the engine's workers on one machine start together, and each would
    otherwise compile every module itself (a process and a few hundred MB each). A process that
    waited finds the cache filled and only loads. Two warm-ups of one module ("module" and
    "module:function") compile different kernels, so they do not wait for each other. A side
    process's entry point."""
    module, function = warm_up_target(name)
    spec = importlib.util.find_spec(module)
    key = (f"{spec.origin if spec else module}:{function}|{os.environ.get('NUMBA_CACHE_DIR', '')}"
           f"|{sys.version_info[:2]}")
    path = os.path.join(tempfile.gettempdir(), f"eplb-compile-{hashlib.sha1(key.encode()).hexdigest()[:16]}.lock")
    try:
        import fcntl
    except ImportError:  # no POSIX file locks (Windows): compile without waiting for the others
        fcntl = None
    try:
        lock = open(path, "a")
    except OSError:  # another user's lock file, a read-only temp folder: compile without it
        lock = None
    try:
        if fcntl is not None and lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes (or the process ends)
        getattr(importlib.import_module(module), function)()
    finally:
        if lock is not None:
            lock.close()


def _start_compile(module: str, **popen_kw) -> subprocess.Popen:
    """A process that runs `module.warm_up()` (`compile_once`), compiling its kernels into numba's cache."""
    # The side process imports the same eplb (sys.path may have been extended at run time).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    code = f"from eplb.core.jit import compile_once; compile_once({module!r})"
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, **popen_kw)


def compile_detached(module: str) -> subprocess.Popen:
    """Start compiling one module's kernels in a process of its own that nobody waits for and
    that outlives this one (a command that runs in numpy meanwhile; its later runs load them).
    A daemon thread reaps it when it ends, so a caller that lives for days (a server) keeps no
    zombie; a command that exits first leaves it to the system."""
    proc = _start_compile(module, stderr=subprocess.DEVNULL, start_new_session=True)
    threading.Thread(target=proc.wait, name="eplb-compile-reaper", daemon=True).start()
    return proc


class CachedKernels:
    """A kernel module (one with `warm_up()`) for a command that must not wait for a compile.

    `get()` loads it from numba's cache on first use in the process; on a cold cache it starts
    one detached compile for later runs (`compile_detached`) and returns None, and the caller
    computes in numpy meanwhile, to the same result. `get(wait=True)` compiles here if need be."""

    def __init__(self, module: str):
        self.module = module
        self._loaded = None
        self._compiling: subprocess.Popen | None = None

    def get(self, wait: bool = False):
        """The loaded module, or None while a cold cache compiles it (never with wait=True)."""
        if self._loaded is None:
            if wait or load_cached((self.module,)):
                loaded = importlib.import_module(self.module)
                loaded.warm_up()
                self._loaded = loaded
            elif self._compiling is None:
                self._compiling = compile_detached(self.module)
        return self._loaded


def compile_in_side_processes(modules: tuple[str, ...]) -> list[str]:
    """Compile the kernels of each module in a process of its own (all at once) so that they
    land in numba's cache; returns the failures (module: reason), empty when all compiled."""
    procs = [(name, _start_compile(name, stderr=subprocess.PIPE)) for name in modules]
    failed = []
    for name, proc in procs:
        try:
            _, err = proc.communicate(timeout=_SIDE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            failed.append(f"{name}: still compiling after {_SIDE_TIMEOUT_S:.0f} s")
            continue
        if proc.returncode != 0:
            last = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
            failed.append(f"{name}: {last[0]}")
    return failed


class Warmup:
    """Loading (and on a cold cache, compiling) a set of kernel modules on a daemon thread."""

    def __init__(self, modules: tuple[str, ...]):
        self.modules = tuple(modules)
        self.status = "not started"
        """"loading", "compiling in side processes", "ready", or "failed: ..." (the kernels
        then compile on first use, in the calling thread)."""
        self.compiled = False
        """True when the cache was cold and the kernels were compiled for this warm-up."""
        self.seconds: float | None = None
        """Wall time from start to ready (None until then)."""
        self._done = threading.Event()
        self._known = threading.Event()    # set once the probe found the cache warm or cold
        self._thread: threading.Thread | None = None

    def start(self) -> Warmup:
        if self._thread is None:
            self.status = "loading"
            self._thread = threading.Thread(target=self._run, name="eplb-kernel-warmup", daemon=True)
            self._t0 = time.perf_counter()
            self._thread.start()
        return self

    def _run(self) -> None:
        try:
            if not load_cached(self.modules):
                self.compiled = True
                self._known.set()
                failed = []
                if os.environ.get("EPLB_COMPILE_IN_PROCESS", "") in ("", "0"):
                    self.status = "compiling in side processes"
                    failed = compile_in_side_processes(self.modules)
                # Loads what the side processes cached; compiles here whatever they could not.
                _warm_up(self.modules)
                if failed:
                    self.status = "ready (compiled in this process: " + "; ".join(failed) + ")"
                    return
            self.status = "ready"
        except Exception as exc:  # the kernels then compile on first use, where the error shows
            self.status = f"failed: {type(exc).__name__}: {exc}"
        finally:
            self.seconds = time.perf_counter() - self._t0
            self._done.set()
            self._known.set()

    @property
    def ready(self) -> bool:
        return self._done.is_set()

    @property
    def compiling(self) -> bool:
        """True while the cache was found cold and the kernels are being compiled (a wait of
        tens of seconds, not the second a load from the cache takes)."""
        return self.compiled and not self._done.is_set()

    def wait_until_known(self, timeout: float | None = None) -> bool:
        """Block until it is known whether the kernels load from the cache (then ready) or
        compile (then `compiling`): about a second, numba's import; False on timeout."""
        if self._thread is None:
            self.start()
        return self._known.wait(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the kernels are loaded (or the warm-up gave up); False on timeout."""
        if self._thread is None:
            self.start()
        return self._done.wait(timeout)


_warmups: dict[tuple[str, ...], Warmup] = {}
_warmups_lock = threading.Lock()


def warm_up_in_background(modules: tuple[str, ...]) -> Warmup:
    """The process's warm-up of these kernel modules, started on first request (later calls
    with the same modules return the same one)."""
    key = tuple(modules)
    with _warmups_lock:
        w = _warmups.get(key)
        if w is None:
            w = _warmups[key] = Warmup(key).start()
        return w


def loaded_kernel(name: str):
    """Kernel module `name` if this process has loaded it and its warm-up has run (its `ready`
    flag), else None; never imports it. A module another thread is still importing (the
    background warm-up, importing numba first) is already in sys.modules without its
    attributes: it counts as not loaded, and the caller goes on in numpy."""
    mod = sys.modules.get(name)
    return mod if getattr(mod, "ready", False) else None


def kernel_floats(a) -> np.ndarray:
    """a as the float64 array type the kernels are compiled for: writable and C-ordered (a
    itself when it is one, else a copy).

    numba compiles one machine-code version per argument type, and a read-only or strided array
    is another type than a writable C-ordered one: feeding the kernels one kind keeps them to
    the one version each that their `warm_up` compiles or loads ahead of the first call."""
    return kernel_array(a, np.float64)


def kernel_ints(a) -> np.ndarray:
    """a as the int64 array type the kernels are compiled for (see `kernel_floats`)."""
    return kernel_array(a, np.int64)


def kernel_array(a, dtype) -> np.ndarray:
    """a as the kernels' array type of dtype (see `kernel_floats`)."""
    a = np.asarray(a)
    if a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable:
        return a
    return np.array(a, dtype=dtype, order="C")
