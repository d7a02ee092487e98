"""Compiled-kernel cache.  Keys are explicit tuples that include the backend, its arch and device
(``Backend.cache_key``) and the builder's frozen spec, so a kernel can never be served to a call it
was not built for.  Builds run under one lock: concurrent first calls build each kernel once."""
import threading
from collections import Counter

_lock = threading.RLock()
_kernels = {}
builds = Counter()   # key -> number of times it was built (tests assert 1)


def get(key, build):
    kernel = _kernels.get(key)
    if kernel is None:
        with _lock:
            kernel = _kernels.get(key)
            if kernel is None:
                kernel = build()
                builds[key] += 1
                _kernels[key] = kernel
    return kernel


def entries():
    return dict(_kernels)
