"""C++ kernels for CPUs: the small operations of a decode step, fused (``fused_ops.py``)."""
