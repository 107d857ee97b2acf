"""Exceptions shared across tensoralg."""

from __future__ import annotations

__all__ = ["TrainingDiverged", "CostTooHigh", "AttentionNotSupported"]


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
