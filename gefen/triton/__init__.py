"""Fused Triton kernels for Gefen's step on CUDA tensors (issue 15); Triton is optional.

Nothing here imports Triton until a kernel is asked for: ``available()`` tries the import once.
"""
