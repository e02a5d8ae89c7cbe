"""C++ kernels for CPUs: the small operations of a decode step, fused (``fused_ops.py``);
and the memory a step streams, on huge pages (``huge_pages.py``)."""
