"""Backends: numpy_backend (the readable reference) and cuda_backend (CuPy + kernels/*.cu)."""
