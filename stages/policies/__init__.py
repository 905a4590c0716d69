"""Cutoff policies: one interface, used unchanged by ``bdsgd simulate`` and ``bdsgd train``.

``make_policy(spec, num_workers, ...)`` builds one from its spec (``bdsgd.stages.policies.registry``).
"""

from bdsgd.stages.policies.base import Policy, Predictor
from bdsgd.stages.policies.registry import SPECS, default_policy_specs, make_policy

__all__ = ["SPECS", "Policy", "Predictor", "default_policy_specs", "make_policy"]
