"""A rank's compute time, measured before the collective (which makes every rank's wall time
look alike). On a GPU the span is timed with CUDA events on the current stream and the end
event is waited for, so the rank takes its arrival ticket when its computation is really done;
on the CPU it is the wall clock."""

from __future__ import annotations

import time

import torch


class ComputeTimer:
    """``start()`` at the top of an iteration, ``mark()`` after each micro-batch (keeps the host
    at most one micro-batch ahead of the GPU, so a cut is seen where the GPU is), ``stop()``
    when the rank's computation ends; returns seconds."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.begun = 0.0
        self.events: list = []

    def start(self) -> None:
        self.begun = time.perf_counter()
        if self.cuda:
            self.events = [self._event()]

    def mark(self) -> None:
        """After a micro-batch: on a GPU, wait for the one before it (one in flight)."""
        if self.cuda:
            self.events.append(self._event())
            if len(self.events) > 2:
                self.events[-2].synchronize()

    def stop(self) -> float:
        if not self.cuda:
            return time.perf_counter() - self.begun
        end = self._event()
        end.synchronize()
        return self.events[0].elapsed_time(end) / 1e3

    def elapsed_wall(self) -> float:
        return time.perf_counter() - self.begun

    @staticmethod
    def _event():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
