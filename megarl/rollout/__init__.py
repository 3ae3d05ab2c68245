"""The vLLM rollout fleet: engine replicas (each with its own TP size) as Ray actors.

``RolloutFleet`` generates n samples per prompt with per-token rollout log-probs, scores given
tokens (``compute_log_probs``), serves the weights the sync gives it (``megarl.weight_sync``) and
sleeps/wakes the engines in colocated GPU mode. Start Ray first with ``megarl.cluster.ray_cluster.init_ray``.
"""
from megarl.rollout.client import GenerateClient
from megarl.rollout.fleet import RolloutFleet, split_evenly
from megarl.rollout.sample import Generation, RolloutSample
from megarl.rollout.sampling import SAMPLING_KEYS, Sampling, request_seed, resolve_sampling, turn_seed

__all__ = ["GenerateClient", "Generation", "RolloutFleet", "RolloutSample", "SAMPLING_KEYS", "Sampling",
           "request_seed", "resolve_sampling", "split_evenly", "turn_seed"]
