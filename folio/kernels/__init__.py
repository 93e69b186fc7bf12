"""Hand-written kernels, compiled on first use (plain C + OpenMP through ctypes, no torch headers to build)."""
