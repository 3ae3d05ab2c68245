"""Rewards: rule rewards by data_source, custom reward functions by path, and the batch reward manager."""
from megarl.rewards.custom import RewardFunction, RewardFunctionLoadError
from megarl.rewards.manager import RewardFunctionError, RewardManager, RewardResult, SampleError
from megarl.rewards.registry import UnknownDataSourceError, default_compute_score
from megarl.rewards.token_scores import scores_to_token_level

__all__ = [
    "RewardFunction",
    "RewardFunctionError",
    "RewardFunctionLoadError",
    "RewardManager",
    "RewardResult",
    "SampleError",
    "UnknownDataSourceError",
    "default_compute_score",
    "scores_to_token_level",
]
