"""Compatibility shims that must run before numba.cuda is imported."""
import numpy as np

# numba-cuda 0.30 still registers an overload for np.row_stack, which NumPy 2.4 removed; without
# this alias its first kernel compile fails under NumPy >= 2.4 (the H200 image ships NumPy 2.5).
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack
