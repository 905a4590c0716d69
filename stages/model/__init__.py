"""The amortized deep generative run-time model: Pyro model and guide (``runtime_model``), data
preparation (``data``), checkpoints (``checkpoint``), the per-iteration predictor for policies
(``predictor``) and held-out evaluation (``evaluate``)."""

from bdsgd.stages.model.predictor import RuntimePredictor, load_predictor

__all__ = ["RuntimePredictor", "load_predictor"]
