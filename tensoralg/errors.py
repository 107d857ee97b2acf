"""Exceptions (and the warning helper) shared across tensoralg."""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["TrainingDiverged", "CostTooHigh", "AttentionNotSupported", "warn_caller"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_caller(message: str, category: type = UserWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside the tensoralg package (the
    user's line), however deep inside the package the warning is raised."""
    level, frame = 1, sys._getframe(0)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


class TrainingDiverged(RuntimeError):
    """Training produced a NaN/inf loss or NaN/inf weights (learning rate too high?).

    Attributes:
        step: the optimizer step at which it was detected.
        last_checkpoint: the last good checkpoint written before it, or None (the weights in
            memory are unusable: discard them, do not save them).
    """

    def __init__(self, msg: str, step: int, last_checkpoint: str | None = None):
        super().__init__(msg)
        self.step = step
        self.last_checkpoint = last_checkpoint


class CostTooHigh(ValueError):
    """An exact computation whose estimated cost (FLOPs, memory or Wick configurations) is over
    the budget. Raised by the planner before any contraction or allocation; the message names
    each strategy's estimate and the alternatives (``method="closure"``, ``"montecarlo"``, or a
    larger budget)."""


class AttentionNotSupported(ValueError):
    """The exact attention path does not handle this model (raised before any contraction)."""
