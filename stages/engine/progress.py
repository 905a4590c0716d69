"""Where a synchronous engine stands in its iterations, in one object: what it has begun and
announced, the iteration it is admitting, whether that one was aborted, whether the run is
stopping, and where the last regrouping resumed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Progress:
    """A sync engine's per-iteration state (its engine's loop and failure handling move it)."""

    begun: int = -1  # the last iteration whose c was chosen
    announced: int = -1  # the last iteration announced
    through: int = -1  # the last iteration the announcements under way cover
    admitting: int | None = None  # the iteration whose tickets (or step) are being read
    aborted: bool = False  # the iteration under way ends now, without an update
    started: float = 0.0  # when the iteration under way began (perf_counter)
    sent: np.ndarray | None = None  # the workers it was started on
    stopping: bool = False  # after a stop: only what was announced is run
    resume_at: int = -1  # where the last regrouping of a block announced ahead resumed
