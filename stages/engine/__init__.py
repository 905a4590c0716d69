"""The distributed engine behind ``bdsgd profile`` and ``bdsgd train``: one shape, three variants.

The worker side (what a worker process imports; nothing of the engine side):

- ``config.py``: :class:`EngineConfig`, the optimizer and the learning-rate scaling.
- ``protocol.py``: the wire: every c10d store key and encoding of every variant, payloads, the
  store helpers, the one gloo group builder, the star sum.
- ``worker_report.py``: :class:`WorkerReport`, the one encoding of a computation from worker to
  trace.
- ``spawned.py``: a spawned worker's first code (SIGINT, SIGTERM ignored before torch is
  imported) and its last (an engine's worker exits without the interpreter's finalisation).
- ``worker.py``: what every worker does, and the parameter-server worker; ``replica.py``: the
  collective engine's worker (``replica_membership.py``: its generation and group;
  ``replica_steps.py``: its steps on their way to the coordinator); ``async_worker.py``: the
  asynchronous worker.

The engine side:

- ``base.py``: :class:`Engine`, what every variant shares (loop, liveness, metrics row, trace rows,
  resume state) and :class:`ServerModel` (parameters held by an engine process).
- ``sync.py``: :class:`SyncEngine`, the cutoff iteration (choose, announce, admit tickets through
  the policy driver: ``admission.py``, close, apply, observe, record; where it stands:
  ``progress.py``) shared by ``ps.py``
  (:class:`ParameterServer`: holds the model, sends parameters, receives the admitted gradients)
  and ``collective.py`` (:class:`Coordinator`: holds nothing; the replicas cut inside one
  all-reduce among themselves, gloo on CPU, NCCL on GPU; ``announcer.py``, ``regroup.py``,
  ``step_log.py`` and ``replica_outputs.py`` are its parts).
- ``async_server.py``: :class:`AsyncServer`, k-async, async, adasync.
- ``janitor.py``: deletes the store keys of iterations long past.
- ``resume.py``: a run directory's resume state and the iteration log's segments.
- ``launch.py``: the control store, spawned workers (or torchrun ranks), checkpoints, shutdown.

Every variant's workers take an atomic ticket from the c10d store when their gradient is ready
and write their :class:`WorkerReport` under it, so "first c" is decided in one round trip, across
machines too. See docs/architecture.md.
"""
