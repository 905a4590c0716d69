"""Opt-in benchmarks (``make bench``). Each ``bench_*.py`` exposes ``run(quick=False) -> str``
returning one Markdown section; ``benchmarks.run`` assembles them into
docs/benchmarks-generated.md (docs/benchmarks.md is the hand-written reference)."""

import os

# The engine's early-ending waits time out by design; c10d would log each one (set before torch).
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
