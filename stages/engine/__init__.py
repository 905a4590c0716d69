"""The parameter server behind ``bdsgd train`` of the asynchronous policies (``k-async:K``,
``async``, ``adasync``): stragglers keep computing and their gradients are applied late. Every
synchronous policy runs on the library's loop (:mod:`bdsgd.stages.loop`) instead.

The worker side (what a worker process imports; nothing of the server side):

- ``config.py``: :class:`EngineConfig`, the optimizer and the learning-rate scaling.
- ``worker.py``: what every worker does (workload, delays, micro-batches, timing, report);
  ``async_worker.py``: the asynchronous worker loop.

The server side:

- ``base.py``: :class:`Engine` (loop, liveness, metrics row, trace rows, resume state) and
  :class:`ServerModel` (parameters held by the server process).
- ``async_server.py``: :class:`AsyncServer`, k-async, async, adasync.
- ``resume.py``: a run directory's resume state and the iteration log's segments.
- ``launch.py``: the control store, spawned workers (or torchrun ranks), checkpoints, shutdown.

The wire both sides share (store keys, the report encoding, spawned processes, torchrun's
variables) is :mod:`bdsgd.stages.wire`, which the library's loop uses too. See
docs/architecture.md.
"""
