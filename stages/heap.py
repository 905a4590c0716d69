"""Keep freed memory in the process while a fit runs (glibc; elsewhere nothing changes).

Every SVI step allocates and frees the same few tensors of megabytes (the encoder's
(batch, window, workers, hidden) activations and their gradients). glibc hands freed blocks
above its mmap threshold, and a free heap top above its trim threshold, back to the kernel, so
each step pays page faults and zeroed pages for memory it held a moment before: a quarter of a
step at 32 workers on this project's 2-core machine. :func:`retained_heap` raises both
thresholds while it is open (what ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_``
would do for a whole process), then sets glibc's default values again and returns the free
memory to the kernel (``malloc_trim``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Iterator
from contextlib import contextmanager

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30
MMAP_THRESHOLD_OLD_MAX = 32 << 20  # the ceiling of glibc before 2.35 on 64-bit systems
TRIM_THRESHOLD = 2 << 30
GLIBC_DEFAULT = 128 << 10  # both thresholds' initial value in glibc


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "mallopt") else None
    except OSError:
        return None


@contextmanager
def retained_heap() -> Iterator[None]:
    """Freed memory stays with the process inside the block (see the module docstring)."""
    libc = _glibc()
    if libc is None:
        yield
        return
    if not libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_OLD_MAX)
    libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, GLIBC_DEFAULT)
        libc.mallopt(M_TRIM_THRESHOLD, GLIBC_DEFAULT)
        libc.malloc_trim(0)
