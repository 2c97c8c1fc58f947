"""Optional numba compilation of the few hot loops (Featurizer, simulator decode step).

The hot loops are written once, as plain Python over numpy arrays and scalars that numba can
compile. :func:`maybe_njit` compiles them when numba is importable (the ``serve``, ``train``
and ``dev`` extras install it) and returns them unchanged otherwise, so the core install (the
SGLang hook, which never imports these modules' kernels) needs no compiler and every caller
runs the same source either way. ``SPECDEPTH_NO_JIT=1`` (or numba's own
``NUMBA_DISABLE_JIT=1``) forces the plain-Python path, e.g. to check that both agree.

Compiled functions are cached on disk (``cache=True``, in ``__pycache__`` next to the source):
the first process compiles them (all of them: ~6.5 s on the 2-core development box), later
processes load the machine code (~0.5 s, plus ~0.3 s to import numba). numba invalidates a
cached function when its own source file changes, not when a compiled function it calls
from another file does; so no cached kernel calls a kernel of another module (a stale cache
would otherwise keep running old code; ``tests/test_jit_parity.py`` would catch it). Kernels
that do (the serving path's fused Featurizer + policy kernel) are compiled per process with
:func:`njit_uncached`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def _numba() -> Any | None:
    if os.environ.get("SPECDEPTH_NO_JIT", "").strip() not in ("", "0"):
        return None
    try:
        import numba
    except ImportError:
        return None
    return None if numba.config.DISABLE_JIT else numba


_NUMBA = _numba()

JIT_ENABLED: bool = _NUMBA is not None
"""True when :func:`maybe_njit` compiles (numba importable and not disabled)."""


def maybe_njit(fn: F) -> F:
    """``numba.njit(cache=True)`` when :data:`JIT_ENABLED`, else ``fn`` itself.

    A decorated function must be valid numba nopython code *and* correct plain Python: no
    Python objects beyond numpy arrays, numbers, tuples, bytes and other such functions.
    Integer powers are written as float powers (``x ** float(k)``) so both paths call the C
    library's ``pow`` and agree bit for bit.
    """
    if _NUMBA is None:
        return fn
    return _NUMBA.njit(cache=True)(fn)  # type: ignore[no-any-return]


def njit_uncached(fn: F) -> F | None:
    """``numba.njit(fn)`` compiled in this process only, or None when :data:`JIT_ENABLED` is off.

    For kernels that join kernels of other modules, or build in data of this process as
    constants (a policy's weights): numba's disk cache could not tell when those change.
    Callers keep a plain-Python path for None.
    """
    if _NUMBA is None:
        return None
    return _NUMBA.njit(fn)  # type: ignore[no-any-return]


def maybe_njit_reassoc(fn: F) -> F:
    """:func:`maybe_njit` that also lets LLVM reassociate float sums and fuse multiply-adds.

    For dot products, whose sums then run in SIMD lanes: the result may differ from a strict
    left-to-right sum in the last bits (as numpy's BLAS does too). NaN and infinity keep
    their meaning (no ``nnan``/``ninf`` flags).
    """
    if _NUMBA is None:
        return fn
    return _NUMBA.njit(cache=True, fastmath={"reassoc", "contract"})(fn)  # type: ignore[no-any-return]
