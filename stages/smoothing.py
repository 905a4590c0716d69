"""The smoothed training loss every run compares with its target: ``time_to_loss`` in every
summary, ``--stop-at-target`` on every path."""

from __future__ import annotations

ALPHA = 0.1
"""The weight of one iteration in the exponentially weighted training loss."""


class SmoothedLoss:
    """The exponentially weighted training loss ``time_to_loss`` compares with the target
    (``alpha``: the weight of one iteration; iterations without a loss are skipped)."""

    def __init__(self, alpha: float = ALPHA) -> None:
        self.alpha = alpha
        self.value: float | None = None

    def add(self, loss: float | None) -> float | None:
        if loss is not None:
            a = self.alpha
            self.value = loss if self.value is None else (1 - a) * self.value + a * loss
        return self.value


def time_to_loss(log: dict, target: float | None, alpha: float = ALPHA) -> float | None:
    """Wall-clock seconds until the EWMA-smoothed training loss first reaches ``target``."""
    if target is None:
        return None
    smooth = SmoothedLoss(alpha)
    for loss, wall in zip(log.get("loss", []), log.get("wall_s", []), strict=False):
        if loss is not None and smooth.add(loss) <= target:
            return float(wall)
    return None
