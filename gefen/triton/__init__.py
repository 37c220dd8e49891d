"""Fused Triton kernels for Gefen's step on CUDA tensors; Triton is optional.

Nothing here imports Triton until a kernel is asked for: ``dispatch.available()`` tries the import once.
"""
