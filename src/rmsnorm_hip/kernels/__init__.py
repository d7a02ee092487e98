"""Kernel builders.  Each ``make_*`` takes an intrinsics namespace and a frozen spec and returns a
plain Python kernel function for the backend to compile; kernels call nothing vendor-specific."""
