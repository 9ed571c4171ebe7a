"""Compiled kernels that never keep a caller waiting for a compile.

A kernel is a function written in the part of Python that numba compiles (loops over numpy
arrays and scalars), marked `@kernel`. It is one implementation with two ways to run: as
machine code, and as the plain Python it is written in. A call
1. runs the machine code when this process has it for these argument types;
2. else loads it from numba's cache on disk (`cache=True`: beside the module in `__pycache__`,
   or under NUMBA_CACHE_DIR), once per process: tens of milliseconds;
3. else asks a side process to compile it into that cache, and runs the function as plain
   Python meanwhile: the same source, so the same result, 30-200x slower (a DeepSeek-V3
   rebalance at 32 GPUs: about a second instead of 10 ms, where waiting for the compile would
   take minutes). A call after the side process is done loads the machine code (step 2).
Kernels call each other as ordinary functions: compiled, numba links the callee in (inlined
where it is marked `inline=True`); interpreted, the callee runs interpreted too.

The side processes (eplb/core/_side_compile.py) share no GIL with the caller; one runs at a
time per process (two on machines with more than four cores), and processes on one machine
that want the same kernel take turns (a file lock), so an engine's workers starting together compile it once. A side
process outlives a short command that started it, so the next run finds the cache warm.

One compiled version per kernel: arrays reach kernels as writable C-ordered int64 or float64
arrays (`kernel_ints`, `kernel_floats`) and scalars as Python ints and floats, so the argument
types, and the cache entry with them, stay the same from call to call. A call with new types
is a first call again (step 2 or 3), never a compile in the calling thread.

EPLB_JIT picks the mode: "auto" (the default, as above); "wait" (a kernel the cache lacks is
compiled in the calling thread, as plain numba does: benchmarks and the test suite, which
want machine code from the first call); "off" (always interpreted: debugging, or a machine
without numba). A side process that fails leaves its kernel interpreted in this process and
says why in `status()`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import threading
from collections.abc import Callable
from contextlib import contextmanager

import numpy as np

from eplb.core._side_compile import MODE_ENV, SIDE

MODES = ("auto", "wait", "off")
"""A side process still compiling after this long is stopped (its kernel stays interpreted)."""


def mode() -> str:
    """EPLB_JIT, checked: "auto" (the default), "wait" or "off"."""
    value = os.environ.get(MODE_ENV, "").strip().lower() or "auto"
    if value not in MODES:
        from eplb.errors import EplbError

        raise EplbError(f"{MODE_ENV}={value!r} is not a jit mode: use one of {', '.join(MODES)} (or leave it unset)")
    return value


_COMPILES = threading.RLock()
"""Held by every compile or cache load in this process. Each of them switches compiling on for
the dispatchers it may touch and off again when done; two at once (a planner's worker threads
calling different kernels for the first time) would switch off a callee the other is still
linking, and numba would raise "compilation disabled". numba compiles under one global lock
anyway, so nothing runs slower."""

_local = threading.local()
"""Per thread: `interpreting` (a kernel runs as Python: the kernels it calls run so too) and
`log` (the kernels that ran interpreted inside `record()`)."""


class Kernel:
    """A function numba may compile; callable like the function (see the module docstring).

    `targetoptions` and `py_func` are the names numba's inliner reads from a callee, so a
    kernel marked inline is inlined into the kernels that call it."""

    def __init__(self, py_func: Callable, targetoptions: dict):
        functools.update_wrapper(self, py_func)
        self.py_func = py_func
        self.targetoptions = targetoptions
        self._dispatcher = None
        self._run = None            # the dispatcher, once it holds machine code for the types seen
        self._state: dict = {}      # signature -> "compiling" | "compiled" | "failed: ..."
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return f"{self.py_func.__module__}.{self.py_func.__qualname__}"

    @property
    def dispatcher(self):
        """numba's dispatcher of this kernel (numba is imported on first use)."""
        if self._dispatcher is None:
            numba = _numba()
            with self._lock:
                if self._dispatcher is None:
                    self._dispatcher = numba.njit(**self.targetoptions)(self.py_func)
        return self._dispatcher

    def __repr__(self) -> str:
        return f"<kernel {self.name}>"

    def __call__(self, *args):
        if getattr(_local, "interpreting", False):   # inside a kernel running as Python
            return self.py_func(*args)
        run = self._run
        if run is not None and os.environ.get(MODE_ENV) != "off":
            try:
                return run(*args)
            except TypeError:
                if self._signature(args) in run.overloads:
                    raise  # the kernel's own error, not a type it has no machine code for
        return self._first_call(args)

    def _signature(self, args) -> tuple:
        from numba.core.typing.typeof import Purpose, typeof

        return tuple(typeof(a, Purpose.argument) for a in args)

    def _first_call(self, args):
        how = mode()
        if how == "off":
            return self._interpret(args)
        d = self.dispatcher
        sig = self._signature(args)
        with self._lock:
            if how == "wait":
                _compile_here(d, sig)   # returns the overload another thread made meanwhile, if any
                self._run = d
                self._state[sig] = "loaded"
                _touched(self)
                return d(*args)
            _touched(self)
            state = self._state.get(sig)
            if state in (None, "compiled") and _load_cached(d, sig):
                d.disable_compile()  # a call with new types comes back here, never compiles in place
                self._run = d
                self._state[sig] = "loaded"
            elif state is None:
                self._state[sig] = "compiling"
                SIDE.request(self, sig)
            elif state == "compiled":  # the side process said done, yet the cache has nothing
                self._state[sig] = "failed: compiled in a side process, but not found in numba's cache"
        if self._run is not None and sig in self._run.overloads:
            return self._run(*args)
        return self._interpret(args)

    def _interpret(self, args):
        log = getattr(_local, "log", None)
        if log is not None:
            log.add(self.name)
        _local.interpreting = True
        try:
            with np.errstate(all="ignore"):  # numba's arithmetic raises no floating-point warnings
                return self.py_func(*args)
        finally:
            _local.interpreting = False

    def _finished(self, sig, state: str) -> None:
        with self._lock:
            if self._state.get(sig) == "compiling":
                self._state[sig] = state


def kernel(fn: Callable | None = None, *, inline: bool = False, error_model: str = "python"):
    """Mark `fn` a kernel (`@kernel`, `@kernel(inline=True)`).

    inline: numba compiles the function into each kernel that calls it (a stage with one
      caller: one function to optimise instead of two);
    error_model: "numpy" makes a division by zero give inf or nan instead of raising.
    Every kernel releases the GIL and is cached on disk."""
    options = {"nogil": True, "cache": True, "error_model": error_model}
    if inline:
        options["inline"] = "always"

    def wrap(f: Callable) -> Kernel:
        f._eplb_kernel = True   # cached under its folder's kernels' stamp (`_install_folder_stamps`)
        return Kernel(f, options)

    return wrap if fn is None else wrap(fn)


@contextmanager
def record():
    """Collect the names of the kernels that run interpreted in this thread inside the block
    (a set, yielded): how a caller reports that it ran before the machine code was ready."""
    outer = getattr(_local, "log", None)
    _local.log = names = set()
    try:
        yield names
    finally:
        _local.log = outer
        if outer is not None:
            outer |= names


def status() -> dict[str, str]:
    """Every kernel this process called, with each argument type list's state: "loaded"
    (machine code), "compiling" (a side process is at it; calls run interpreted), "compiled"
    (ready to load on the next call), or "failed: reason" (interpreted in this process)."""
    out = {}
    for k in list(_KERNELS):
        for sig, state in list(k._state.items()):
            out[f"{k.name}({', '.join(map(str, sig))})"] = state
    return out


_KERNELS: list[Kernel] = []
"""Every kernel called from Python in this process, in order of first call."""


def _touched(k: Kernel) -> None:
    if k not in _KERNELS:
        _KERNELS.append(k)


def wait(timeout: float | None = None) -> bool:
    """Block until no side process is compiling for this process (or the timeout passes: False)."""
    return SIDE.idle(timeout)


# --------------------------------------------------------------------------------------------
# numba, imported on first use


_numba_module = None


def _numba():
    """numba, imported once, with kernels known to its type system: a kernel named inside
    another is typed as its dispatcher, so numba compiles the call as a call of a jitted function."""
    global _numba_module
    if _numba_module is None:
        import numba
        from numba.core import types
        from numba.extending import typeof_impl

        @typeof_impl.register(Kernel)
        def _typeof_kernel(val, c):
            return types.Dispatcher(val.dispatcher)

        _install_refusal()
        _install_folder_stamps()
        _numba_module = numba
    return _numba_module


def _compile_here(dispatcher, sig) -> None:
    """Compile `sig` in this thread ("wait" mode). Kernels called from Python refuse new types
    (so a call with them comes back to `_first_call`, and is counted); while this compile types
    its callees, they may need new versions, so all accept them until it is done."""
    with _COMPILES:
        loaded = [k._dispatcher for k in _KERNELS if k._run is not None] + [dispatcher]
        for d in loaded:
            d.disable_compile(False)
        try:
            dispatcher.compile(sig)
        finally:
            for d in loaded:
                if d.signatures:        # numba refuses to disable a dispatcher with none
                    d.disable_compile()


def _install_folder_stamps() -> None:
    """Cache kernels under a stamp of every kernel file in their folder, not their own file's.

    numba compiles a kernel's callees into its machine code but stamps the cache entry with the
    kernel's own source file only: after an edit of a callee in another file (the schedule's
    stages are six files) the caller would load stale machine code. Kernels call only kernels
    of their own folder, so the folder's `*_kernel.py` files are what an entry depends on. The
    entries go to a folder named by that stamp (older ones are removed): numba unpickles a
    cache index before it compares stamps, and an index naming a type since moved fails to load
    instead of missing."""
    from numba.core import caching

    class FolderStamp:
        def __init__(self, py_func, py_file):
            super().__init__(py_func, py_file)
            self._stamp = _folder_stamp(py_file)
            self._base = super().get_cache_path()

        @classmethod
        def from_function(cls, py_func, py_file):
            if not getattr(py_func, "_eplb_kernel", False):
                return None
            return super().from_function(py_func, py_file)

        def get_cache_path(self):
            return os.path.join(self._base, _STAMPED + self._stamp[:16])

        def get_source_stamp(self):
            return self._stamp

        def ensure_cache_path(self):
            super().ensure_cache_path()
            for name in os.listdir(self._base):
                if name.startswith(_STAMPED) and name != _STAMPED + self._stamp[:16]:
                    shutil.rmtree(os.path.join(self._base, name), ignore_errors=True)

    ours = [type(f"Folder{base.__name__}", (FolderStamp, base), {})
            for base in (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator, caching.UserWideCacheLocator)]
    caching.CacheImpl._locator_classes = ours + list(caching.CacheImpl._locator_classes)


_STAMPED = "eplb-kernels-"


def _folder_stamp(py_file: str) -> str:
    """A hash of the names, times and sizes of the kernel files beside py_file (and its own)."""
    folder, own = os.path.split(py_file)
    parts = []
    for name in sorted(os.listdir(folder)):
        if name.endswith("_kernel.py") or name == own:
            st = os.stat(os.path.join(folder, name))
            parts.append((name, st.st_mtime_ns, st.st_size))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


class _Uncached(Exception):
    """A kernel has no machine code in numba's cache (raised inside numba's compile event)."""


_refusing: set[int] = set()


def _install_refusal() -> None:
    """A numba compile-event listener that stops a compile started by a thread that only loads."""
    from numba.core import event

    class _RefuseCompile(event.Listener):
        def on_start(self, ev):
            if threading.get_ident() in _refusing:
                raise _Uncached(ev.data["dispatcher"].py_func.__qualname__)

        def on_end(self, ev):
            pass

    event.register("numba:compile", _RefuseCompile())


def _load_cached(dispatcher, sig) -> bool:
    """Load machine code for `sig` from numba's cache without compiling; False if it has none."""
    me = threading.get_ident()
    with _COMPILES:
        _refusing.add(me)
        dispatcher.disable_compile(False)
        try:
            dispatcher.compile(sig)
            return True
        except _Uncached:
            return False
        finally:
            _refusing.discard(me)


# --------------------------------------------------------------------------------------------
# argument types


def kernel_floats(a) -> np.ndarray:
    """a as the float64 array type kernels take: writable and C-ordered (a itself when it is
    one, else a copy). A read-only or strided array is another numba type, and so another
    compiled version: feeding kernels one kind keeps each to one."""
    return kernel_array(a, np.float64)


def kernel_ints(a) -> np.ndarray:
    """a as the int64 array type kernels take (see `kernel_floats`)."""
    return kernel_array(a, np.int64)


def kernel_array(a, dtype) -> np.ndarray:
    """a as the kernels' array type of dtype (see `kernel_floats`)."""
    a = np.asarray(a)
    if a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable:
        return a
    return np.array(a, dtype=dtype, order="C")
