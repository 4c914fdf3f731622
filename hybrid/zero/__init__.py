"""ZeRO-DP over the data-parallel group: stages 0-3, applied to a model from outside."""

from hybrid.zero.engine import StepResult, ZeroEngine, apply_zero
from hybrid.zero.plan import ShardingPlan

__all__ = ["apply_zero", "ZeroEngine", "StepResult", "ShardingPlan"]
