"""The wire every distributed path shares: the c10d store keys and encodings (``keys.py``), the
one encoding of a computation from rank to trace row (``report.py``), the deletion of long-past
store keys (``janitor.py``), spawned processes and their reaping (``spawned.py``) and torchrun's
variables (``torchrun.py``). It imports no stage and no engine: the library's loop
(:mod:`bdsgd.stages.loop`) and the parameter server (:mod:`bdsgd.stages.engine`) both import it.
"""
