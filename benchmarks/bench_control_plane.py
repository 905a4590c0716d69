"""`make bench`'s section for the control plane at scale: the table of
:mod:`benchmarks.control_plane` (every mode at 64, 256 and 1,024 emulated ranks, and an
online policy at the largest)."""

from benchmarks.control_plane import run

__all__ = ["run"]
