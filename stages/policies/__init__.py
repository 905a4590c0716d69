"""Cutoff policies: one interface, used unchanged by ``bdsgd simulate`` and ``bdsgd train``."""

from stages.policies.base import Policy, Predictor

__all__ = ["Policy", "Predictor"]
