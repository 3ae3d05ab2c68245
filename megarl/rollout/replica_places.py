"""Where each of the fleet's replica slots runs, and starting a replica's actor there.

Placement: the trainer passes ``slots`` (``megarl.cluster.placement``): replica ``i`` starts in
the bundle of its first device slot, and on GPU it makes exactly its slots' GPUs visible to the
engine; a replica whose TP covers whole nodes runs its workers with vLLM's Ray executor in its
slots' bundles. Standalone (no slots), one placement group per replica with one bundle,
``{"CPU": c}`` on CPU and ``{"CPU": c, "GPU": tp}`` on GPU, which the replica actor takes whole.
A slot keeps its place for the fleet's life, so a replacement for a lost replica starts where the
lost one ran (``RolloutFleet.restore``).
"""
from __future__ import annotations

from typing import Any, Sequence


class ReplicaPlaces:
    def __init__(self, backend, spec, use_gpu: bool, bundle: dict, slots: Sequence[Any] | None, size: int,
                 timeout_s: float):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.backend, self.spec, self.use_gpu = backend, spec, use_gpu
        self.groups: list = []
        if slots is None:  # standalone: one placement group per replica
            self.groups = [placement_group([dict(bundle)], strategy="PACK") for _ in range(size)]
            ready, _ = ray.wait([g.ready() for g in self.groups], num_returns=len(self.groups), timeout=timeout_s)
            if len(ready) < len(self.groups):
                self.remove()
                raise TimeoutError(f"the Ray cluster could not place {size} rollout bundles of {bundle} within "
                                   f"{timeout_s:.0f} s: {ray.cluster_resources()}")
            self.places = [(dict(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                                 scheduling_strategy=PlacementGroupSchedulingStrategy(g, placement_group_bundle_index=0)),
                            (), {}) for g in self.groups]
        else:
            self.places = [(slot.options(), () if slot.spans_nodes else tuple(slot.device_ids), slot.vllm_env())
                           for slot in slots]

    def launch(self, slot: int):
        """Start replica ``slot``'s actor in its place (its engine starts in the actor's constructor)."""
        import ray

        options, device_ids, extra_env = self.places[slot]
        env = self.backend.replica_env(self.spec, self.use_gpu)
        actor_class = ray.remote(self.backend.actor_class())
        return actor_class.options(**options, runtime_env={"env_vars": {**env, **extra_env}}).remote(
            slot, self.spec, device_ids)

    def await_started(self, handles: list, timeout_s: float) -> list:
        """Each replica's ``info()`` once its engine started (the engines start in parallel), or the error
        that stopped it (a ``TimeoutError`` for one not started within ``timeout_s``)."""
        import ray

        from megarl.logging.progress import Progress

        refs = {replica.info.remote(): i for i, replica in enumerate(handles)}
        infos: list = [None] * len(refs)
        pending = list(refs)
        with Progress(f"starting {len(refs)} {self.backend.name} engine(s)", total=len(refs), unit="engines") as progress:
            while pending:
                done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, timeout_s - progress.elapsed))
                if not done:
                    for ref in pending:
                        infos[refs[ref]] = TimeoutError(f"its {self.backend.name} engine did not start within "
                                                        f"{timeout_s:.0f} s")
                    break
                try:
                    infos[refs[done[0]]] = ray.get(done[0])
                except Exception as exc:  # noqa: BLE001 - the caller decides (start: fatal; restore: stays lost)
                    infos[refs[done[0]]] = exc
                progress.update()
        return infos

    def remove(self) -> None:
        """Give the standalone placement groups back (the actors are killed first)."""
        from ray.util.placement_group import remove_placement_group

        for group in self.groups:
            remove_placement_group(group)
        self.groups = []
