"""Triton kernels and their launch wrappers, one module per op family.

Importing a module here imports triton. Set TRITON_INTERPRET=1 before that import to run the
kernels on CPU tensors (slow; for tests on machines without a GPU).
"""
