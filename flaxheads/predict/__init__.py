"""Prediction on texts: :class:`Classifier` (load from a run, checkpoint, model folder, head
export or hub id; ``predict`` / ``embed``), :class:`Predictions` (what ``predict`` returns)."""

from flaxheads.predict.batches import TruncationWarning
from flaxheads.predict.classifier import Classifier
from flaxheads.predict.results import Predictions

__all__ = ["Classifier", "Predictions", "TruncationWarning"]
