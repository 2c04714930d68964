"""Kernels: the native CPU decode step and the Triton kernels, each with a torch reference.
Imports nothing of ours."""
