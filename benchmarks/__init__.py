"""Benchmarks of bdsgd (``make bench``); see ``benchmarks/run.py``."""

import os

# The engine's early-ending waits time out by design; c10d would log each one (set before torch).
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
