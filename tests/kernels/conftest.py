"""Triton kernels run on the CPU through Triton's interpreter here.

TRITON_INTERPRET is read when `triton.jit` decorates a kernel, so it must be set before any
kernels.triton_* module (and triton itself) is imported: conftest.py loads before the test
modules of this directory.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
