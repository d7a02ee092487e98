"""One device helper per distinct closure: builders make their helpers anew for every spec, and
numba types and compiles each new function object again, though most are equal to one built for
another spec (the same code over the same captured values).  :func:`share_helpers` points a
built kernel at the first equal helper this process built, so each distinct helper compiles once
per signature: a fifth to a quarter of the catalog's compile time, on either target, and a third
of its memory.  The kernels' code is the same either way (the compile gates' resources match)."""
import dataclasses
import threading
import types

import numpy as np

_canonical = {}     # key -> the first helper built with it (kept alive: keys hold ids)
_lock = threading.Lock()
_SCALARS = (bool, int, str, bytes, type(None))


def share_helpers(kernel):
    """Rebind, in place, every helper function reachable through ``kernel``'s closure (and
    theirs) to the first equal one built in this process; returns ``kernel``.  Call it once the
    builder has returned, when every closure cell holds its final value."""
    with _lock:
        seen = {}
        for cell in kernel.__closure__ or ():
            _rebind(cell, seen)
    return kernel


def _rebind(cell, seen):
    try:
        value = cell.cell_contents
    except ValueError:      # a cell never bound: nothing to share
        return
    if isinstance(value, types.FunctionType):
        shared = _canonical_of(value, seen)
        if shared is not value:
            cell.cell_contents = shared


def _canonical_of(fn, seen):
    if id(fn) in seen:
        return seen[id(fn)]
    seen[id(fn)] = fn                       # a helper reaching itself stays as it is
    for cell in fn.__closure__ or ():
        _rebind(cell, seen)
    try:
        key = (fn.__code__, id(fn.__globals__), _key(fn.__defaults__), _key(fn.__kwdefaults__),
               tuple(_key(cell.cell_contents) for cell in fn.__closure__ or ()))
    except ValueError:      # an unbound cell: this helper is its own
        return fn
    shared = seen[id(fn)] = _canonical.setdefault(key, fn)
    return shared


def _key(value):
    """A key equal for values a helper cannot tell apart: scalars by type and bits (0.0 is not
    -0.0), tuples, dtypes, numba types and frozen specs by value, functions already made
    canonical and every other object by identity."""
    if isinstance(value, _SCALARS):
        return (type(value), value)
    if isinstance(value, (float, np.generic)):
        return (type(value), np.asarray(value).tobytes())
    if isinstance(value, tuple):
        return (type(value), tuple(_key(v) for v in value))
    if isinstance(value, np.dtype):
        return (np.dtype, value.str)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value), tuple(_key(getattr(value, f.name))
                                   for f in dataclasses.fields(value)))
    if type(value).__module__.startswith("numba.") and _hashable(value):
        return (type(value), value)         # numba types: equal when they type alike
    return ("id", id(value))


def _hashable(value):
    try:
        hash(value)
    except TypeError:
        return False
    return True
