"""bdsgd: learn a cluster's joint run-times, cut the stragglers of synchronous SGD.

The public Python API. A script or notebook imports from here, never from ``bdsgd.stages``::

    import bdsgd

    store = bdsgd.TraceStore("traces")                      # Parquet traces, schema v1
    result = bdsgd.run_fit(bdsgd.FitConfig(traces="traces", checkpoint="model.pt"))
    policy = bdsgd.make_policy("ecdf", num_workers=8)

Names load on first use, so ``import bdsgd`` in a training process costs nothing beyond the
module itself: a worker that uses only the training API never loads the trace store, polars,
pyarrow, rich or Pyro.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it (loaded on first access)
_EXPORTS = {
    # traces
    "TraceStore": "bdsgd.stages.store",
    "TraceWriter": "bdsgd.stages.store",
    "RunMatrix": "bdsgd.stages.store",
    "SCHEMA": "bdsgd.schemas.trace_v1",
    "SCHEMA_VERSION": "bdsgd.schemas.trace_v1",
    # stages: one config dataclass and one entry function each
    "ProfileConfig": "bdsgd.stages.profile",
    "run_profile": "bdsgd.stages.profile",
    "ImportConfig": "bdsgd.stages.importer",
    "run_import": "bdsgd.stages.importer",
    "FitConfig": "bdsgd.stages.fit",
    "run_fit": "bdsgd.stages.fit",
    "SimulateConfig": "bdsgd.stages.simulate",
    "run_simulate": "bdsgd.stages.simulate",
    "TrainConfig": "bdsgd.stages.train",
    "run_train": "bdsgd.stages.train",
    "ReportConfig": "bdsgd.stages.report",
    "run_report": "bdsgd.stages.report",
    # the run-time model and the policies
    "load_checkpoint": "bdsgd.stages.model.checkpoint",
    "Policy": "bdsgd.stages.policies.base",
    "make_policy": "bdsgd.stages.policies.registry",
    "IterationDriver": "bdsgd.stages.policies.driver",
    # your own training loop under torchrun
    "Cutoff": "bdsgd.stages.loop.rank",
    "LoopConfig": "bdsgd.stages.loop.config",
    "straggler_delays": "bdsgd.stages.loop.config",
    # workloads of the built-in loop
    "Workload": "bdsgd.stages.workloads",
    # errors a caller may catch
    "BdsgdError": "bdsgd.stages.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'bdsgd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
