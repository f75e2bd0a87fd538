"""Mixed-precision training: dynamic loss scaling and an optimizer wrapper (docs/design.md §10)."""
from amp_rewrite.training.master import MasterWeights
from amp_rewrite.training.optimizer import AmpOptimizer, StepResult
from amp_rewrite.training.scaler import LossScaler

__all__ = ["AmpOptimizer", "LossScaler", "MasterWeights", "StepResult"]
