"""bdsgd inside a user's own training loop (``bdsgd.Cutoff``, the library contract of SPEC).

- :mod:`~bdsgd.stages.loop.config`: :class:`LoopConfig`, every option of a cutoff-controlled loop.
- :mod:`~bdsgd.stages.loop.rank`: what every training rank runs: :class:`Cutoff` and its
  per-iteration :class:`Iteration` (micro-batches that stop at a cut, the all-reduce divided by
  the admitted samples, the learning rate scaled to them, checkpoints). Imports no coordinator,
  trace store, polars, pyarrow or rich.
- :mod:`~bdsgd.stages.loop.timing`: compute time before the collective (CUDA events on a GPU).
- :mod:`~bdsgd.stages.loop.coordinator`: the policy, the tickets and the cut, the trace rows and
  the iteration log; a thread beside one training rank's loop (rank 0 by default), never a rank
  of its own.
"""
