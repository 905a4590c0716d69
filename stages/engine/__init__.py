"""The distributed engine behind ``bdsgd profile`` and ``bdsgd train``: one shape, three variants.

- ``config.py``: :class:`EngineConfig`, the optimizer and the learning-rate scaling.
- ``worker_report.py``: :class:`WorkerReport`, the one encoding of a computation from worker to trace.
- ``protocol.py``: store keys, payloads, the control store and gloo groups.
- ``base.py``: :class:`Engine`, what every variant shares (loop, liveness, metrics row, trace rows,
  checkpoint state) and :class:`ServerModel` (parameters held by an engine process).
- ``sync.py``: :class:`SyncEngine`, the cutoff iteration (choose, announce, admit tickets through
  the policy driver, close, apply, observe, record) shared by:
  - ``ps.py``: :class:`ParameterServer` -- the server holds the model, sends parameters, receives
    the admitted gradients (worker loop: ``worker.py``);
  - ``collective.py``: :class:`Coordinator` -- holds nothing; the replicas (``replica.py``) cut
    inside one all-reduce among themselves (gloo on CPU, NCCL on GPU).
- ``async_server.py`` / ``async_worker.py`` / ``async_protocol.py``: k-async, async, adasync.
- ``launch.py``: the control store, spawned workers (or torchrun ranks), checkpoints, shutdown;
  ``spawned.py``: a spawned worker's first code (SIGINT, SIGTERM ignored before torch is imported).

Every variant's workers take an atomic ticket from the c10d store when their gradient is ready
and write their :class:`WorkerReport` under it, so "first c" is decided in one round trip, across
machines too. See docs/architecture.md.
"""
