"""Prediction on texts: :class:`Classifier` (load from a run, checkpoint, model folder, head
export or hub id; ``predict`` / ``embed``), :class:`Predictions` (what ``predict`` returns)."""
from .batches import TruncationWarning
from .classifier import Classifier
from .results import Predictions

__all__ = ["Classifier", "Predictions", "TruncationWarning"]
