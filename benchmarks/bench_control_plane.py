"""`make bench`'s section for the control plane at scale: the table of
:mod:`benchmarks.control_plane` (both modes at 64, 256 and 1,024 emulated ranks)."""

from benchmarks.control_plane import run

__all__ = ["run"]
