"""One Megatron rank as a Ray actor: the actor, reference and critic engines of that rank.

The controller sends every rank the whole step batch (one Ray object); each rank works on its
data-parallel share (``data_parallel_shard``) and returns its results. All ranks of one
model-parallel group return the same tensors, so the controller keeps one result per DP rank
(``dp_leaders``) and concatenates them in DP order.

Actor, reference and critic share one megatron parallel state, so they share one layout
(``actor_rollout_ref.actor.megatron``, uneven pipeline stages and context parallelism included); the
config validation rejects a different critic layout. The CP ranks of one data-parallel replica work
on the same samples (each on its share of every sequence) and return the same results.

Offload (``megatron.*_offload``): every method enters its phase (``offload_phases.PHASES``), so
what it does not use is in host memory while it runs; the controller enters ``sync`` and
``rollout`` around the engines' wake-ups (``rollout_memory``). Checkpoints are written from
wherever the state is (host or device).

LoRA (``model.lora.rank > 0``, ``lora_setup``): the actor (and the critic with its own
``critic.model.lora``) is built with adapters and a frozen base; the reference is then the
actor's own model with the adapters off (``BaseModelReference``: no second model), unless the
reference starts from another checkpoint. Checkpoints hold the trained tensors only, plus the
adapter in PEFT format (``step_<N>/lora_adapter``).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from megarl.cluster.worker_group import DistributedWorker
from megarl.engine.offload_phases import PHASES, rank_residency
from megarl.models.loading import unwrap
from megarl.settings.worker import WorkerSettings


ARCHITECTURE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "vocab_size", "num_experts", "num_local_experts", "moe_intermediate_size",
                     "n_routed_experts", "q_lora_rank", "kv_lora_rank", "first_k_dense_replace")


def check_same_architecture(checkpoint: str, saved_hf_config: dict | None, hf_path: str) -> None:
    """A converted checkpoint records its HF config: it must describe the model at ``model.path``."""
    if not saved_hf_config:
        return  # a trainer checkpoint: its shapes are checked by the load itself
    from megarl.models import load_hf_config

    current = load_hf_config(hf_path).to_dict()
    differ = [f"{k}: {saved_hf_config.get(k)} vs {current.get(k)}" for k in ARCHITECTURE_KEYS
              if saved_hf_config.get(k) != current.get(k)]
    if differ:
        raise ValueError(f"dist_checkpointing_path={checkpoint} was converted from a different model than "
                         f"actor_rollout_ref.model.path={hf_path} ({'; '.join(differ)}); point model.path at the "
                         f"HF checkpoint it was converted from (its config and tokenizer are used)")


class MegatronWorker(DistributedWorker):
    def setup(self, settings: WorkerSettings) -> None:
        from megarl import platform
        from megarl.engine import BaseModelReference, MegatronActor, MegatronCritic, MegatronReference

        torch.set_num_threads(1)
        self.settings = settings
        self.layout = layout = settings.layout
        platform.initialize_model_parallel(
            tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, etp=layout.etp,
            vpp=layout.vpp if layout.vpp > 1 else None, seed=settings.seed, timeout_s=settings.timeout_s)
        from megatron.core import parallel_state

        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.lora = {name: role.lora for name, role in (("actor", settings.actor_role), ("critic", settings.critic_role))
                     if role is not None}
        self.actor = MegatronActor(self._build("actor"), settings.actor)
        self.ref = None
        self.ref_is_actor_base = False  # LoRA: the reference is the actor's model with its adapters off
        if settings.ref is not None:
            temperature = self.actor.settings.temperature
            if self.lora.get("actor") is not None and settings.ref_role.start == settings.actor_role.start:
                self.ref, self.ref_is_actor_base = BaseModelReference(self.actor, settings.ref, temperature), True
            else:
                self.ref = MegatronReference(self._build("ref"), settings.ref, temperature)
        self.critic = None
        if settings.critic is not None:
            self.critic = MegatronCritic(self._build("critic"), settings.critic)
        own_ref = None if self.ref_is_actor_base else self.ref
        self.residency = rank_residency({"actor": self.actor, "ref": own_ref, "critic": self.critic},
                                        settings.offload, self.rank)
        self.residency.need(PHASES["rollout"], "setup")  # the engines start next: give them the memory
        from megarl.trainer.profiling import rank_profiler

        self.profiler = rank_profiler(settings.profiler, self.rank)  # None: profiling off or not on this rank

    def _build(self, role: str) -> list:
        """This rank's model chunks: the HF weights, or a megatron dist checkpoint (any layout) when given.

        The checkpoint is loaded before the engine wraps the model, so optimizer master weights
        start from it.
        """
        from megarl import platform
        from megarl.engine import checkpoint_extra, load_checkpoint
        from megarl.engine.overrides import without_cpu_conflicts
        from megarl.models import build_model
        from megarl.trainer.lora_setup import build_transforms, load_adapter

        spec = self.settings.role(role)
        overrides = without_cpu_conflicts(dict(spec.overrides), platform.transformer_config_overrides(), role,
                                          log=self.rank == 0)
        transforms = build_transforms(spec.lora, spec.hf_path, overrides)
        if spec.start is None:
            chunks = build_model(spec.hf_path, self.layout, role, config_overrides=overrides, transforms=transforms,
                                 hf_overrides=spec.hf_overrides, freeze_vision_tower=spec.freeze_vision_tower)
        else:
            check_same_architecture(spec.start, (checkpoint_extra(spec.start) or {}).get("hf_config"), spec.hf_path)
            chunks = build_model(spec.hf_path, self.layout, role, load_weights=False, config_overrides=overrides,
                                 transforms=transforms, hf_overrides=spec.hf_overrides,
                                 freeze_vision_tower=spec.freeze_vision_tower)
            load_checkpoint(spec.start, chunks, load_rng=False)  # with LoRA: the base (the adapters stay new)
        if spec.adapter_path:
            load_adapter(spec.adapter_path, chunks, spec.hf_path, self.layout, spec.lora, role)
        return chunks

    def enter_phase(self, phase: str) -> None:
        """Make exactly ``PHASES[phase]`` resident (among the groups with offload on)."""
        self.residency.need(PHASES[phase], phase)

    def resident(self) -> dict[str, bool]:
        """Which groups with offload on are on the device now."""
        return self.residency.resident()

    # ------------------------------------------------------------------ placement facts
    def coords(self) -> dict[str, int]:
        from megatron.core import parallel_state as ps

        return {"rank": self.rank, "dp": self.dp_rank, "dp_size": self.dp_size,
                "tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank()}

    def _shard(self, batch):
        """This data-parallel rank's samples, on the device the models run on."""
        from megarl import platform
        from megarl.engine import data_parallel_shard

        return data_parallel_shard(batch, self.dp_rank, self.dp_size).to(platform.device())

    # ------------------------------------------------------------------ profiling (megarl.trainer.profiling)
    def profile_begin(self, step: int) -> None:
        if self.profiler is not None:
            self.profiler.begin(step)

    def profile_end(self, step: int) -> None:
        if self.profiler is not None:
            self.profiler.end(step)

    def _stage(self, role: str, name: str):
        return self.profiler.stage(role, name) if self.profiler is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ compute
    def compute_log_prob(self, batch, with_entropy: bool = True):
        """(log-probs, entropy), and with router replay R2 the routers' choices (the update replays them)."""
        self.enter_phase("log_prob")
        record = self.actor.settings.router_replay == "R2"
        with self._stage("actor", "log_prob"):
            return _to_host(self.actor.compute_log_prob(self._shard(batch), with_entropy=with_entropy,
                                                        record_routing=record))

    def compute_ref_log_prob(self, batch):
        if self.ref is None:
            raise RuntimeError("no reference model: enable actor.use_kl_loss or algorithm.use_kl_in_reward")
        self.enter_phase("log_prob" if self.ref_is_actor_base else "ref")
        with self._stage("ref", "log_prob"):
            return _to_host(self.ref.compute_ref_log_prob(self._shard(batch)))

    def refresh_reference(self) -> None:
        """``trainer.ref_update_freq``: the reference takes the actor's current weights."""
        if self.ref is None or self.ref_is_actor_base:
            raise RuntimeError("no reference model of its own to refresh (with LoRA the reference is the actor's base)")
        self.enter_phase("refresh_reference")
        self.ref.take_weights(self.actor.runner.chunks)

    def compute_values(self, batch):
        if self.critic is None:
            raise RuntimeError("no critic: it is built when critic.enable is true or the estimator needs values")
        self.enter_phase("values")
        with self._stage("critic", "values"):
            return _to_host(self.critic.compute_values(self._shard(batch)))

    def update_actor(self, batch) -> dict[str, float]:
        self.enter_phase("update_actor")
        with self._stage("actor", "update"):
            return self.actor.update_policy(self._shard(batch))

    def update_critic(self, batch) -> dict[str, float]:
        self.enter_phase("update_critic")
        with self._stage("critic", "update"):
            return self.critic.update_critic(self._shard(batch))

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, root: str, step: int, extra: dict | None) -> str:
        """Save what ``<role>.checkpoint.save_contents`` asks for (the controller state ``extra`` always).
        The critic goes first: ``actor/latest`` moving is then the commit of the pair."""
        from megarl.trainer.checkpointing import save_engine

        if self.critic is not None:
            save_engine(self.critic, self.settings.critic_role.save_contents, f"{root}/critic", step, None,
                        lambda out: self._export_hf("critic", self.critic, out), **self._lora_save("critic"))
        path = save_engine(self.actor, self.settings.actor_role.save_contents, f"{root}/actor",
                           step, extra, lambda out: self._export_hf("actor", self.actor, out), **self._lora_save("actor"))
        return str(path)

    def _lora_save(self, role: str) -> dict:
        """``save_engine`` arguments of a LoRA role: only the trained tensors, the settings and the base
        recorded, and (the actor) the adapter in PEFT format."""
        from megarl.trainer.lora_setup import ADAPTER_EXPORT_DIR, checkpoint_meta

        settings = self.lora.get(role)
        if settings is None:
            return {}
        spec = self.settings.role(role)
        meta = checkpoint_meta(settings, {"megatron": spec.start} if spec.start else {"hf": spec.hf_path})
        exports = {}
        if role == "actor":
            exports[ADAPTER_EXPORT_DIR] = lambda staging: self._export_adapter(staging / ADAPTER_EXPORT_DIR)
        return {"model_part": "trainable", "meta": meta, "exports": exports}

    def _export_adapter(self, out) -> None:
        """The actor's adapter in PEFT format (collective)."""
        from megarl.models import default_transformer_impl
        from megarl.models.lora.peft import save_peft_adapter

        chunks = [unwrap(m) for m in self.actor.model]
        with self.residency.also(("actor.params",), "actor adapter export"):
            save_peft_adapter(chunks, self.settings.actor_role.hf_path, self.layout, self.lora["actor"], out,
                              transformer_impl=default_transformer_impl())

    def _export_hf(self, role: str, engine, out) -> None:
        """``hf_model``: the model as HF safetensors, config and tokenizer files (collective)."""
        import torch.distributed as dist

        from megarl.models.export import copy_tokenizer_files
        from megarl.models import default_transformer_impl, save_hf_checkpoint

        from megarl.models import apply_overrides, load_hf_config

        spec = self.settings.role(role)
        hf_path = spec.hf_path
        config = apply_overrides(load_hf_config(hf_path), spec.hf_overrides)  # the export's config.json says them too
        chunks = [unwrap(m) for m in engine.model]
        with self.residency.also((f"{role}.params",), f"{role} hf export"):  # the gather runs collectives
            save_hf_checkpoint(chunks, config, self.layout, out, role=role, transformer_impl=default_transformer_impl(),
                               source_dir=hf_path)  # the MTP layers it skipped are copied from it
        if dist.get_rank() == 0:
            copy_tokenizer_files(Path(hf_path), Path(out))

    def load_checkpoint(self, actor_path: str, critic_path: str | None) -> dict | None:
        """Resume: load what ``<role>.checkpoint.load_contents`` asks for; returns the controller state.
        Both checkpoints are checked against their manifests first (collective), so a damaged one
        raises ``CheckpointIntegrityError`` before any state changes."""
        from megarl.engine import verify_checkpoint
        from megarl.trainer.checkpointing import load_engine

        self.enter_phase("load")
        if self.critic is not None and critic_path is None:
            raise FileNotFoundError(f"{actor_path} has no matching critic checkpoint")
        verify_checkpoint(actor_path)
        if self.critic is not None:
            verify_checkpoint(critic_path)
        actor = self.settings.actor_role.load_contents
        extra = load_engine(self.actor, actor_path, actor, "actor_rollout_ref.actor.checkpoint.load_contents", verify=False)
        if self.critic is not None:
            load_engine(self.critic, critic_path, self.settings.critic_role.load_contents,
                        "critic.checkpoint.load_contents", load_rng=False, verify=False)
        return extra

    def nonfinite_params(self, roles: list[str]) -> dict[str, dict]:
        """Per role (``actor``, ``critic``): how many weight tensors hold inf/NaN on all ranks, and this
        rank's first (collective: ``megarl.engine.finite``; the controller asks before a sync or a save)."""
        from megarl.engine.finite import nonfinite_tensors

        report = {}
        for role in roles:
            count, local = nonfinite_tensors(named_weights({"actor": self.actor, "critic": self.critic}[role].model))
            report[role] = {"count": count, "first": local[0] if local else None}
        return report

    # ------------------------------------------------------------------ weight sync (sender)
    def _local_shards(self):
        """This rank's HF-named pieces: views into the live parameters (no copy)."""
        from megarl.models import default_transformer_impl, export_hf_pieces
        from megarl.weight_sync.sender import from_export

        # the engine built the chunks with default_transformer_impl() (TE's layer spec on a GPU with TE): its names
        chunks = [unwrap(m) for m in self.actor.model]
        pieces = export_hf_pieces(chunks, self.settings.actor_role.hf_path, self.layout, replicas=True,
                                  transformer_impl=default_transformer_impl())
        return from_export((p.hf_name, p.hf_slice, p.tensor) for p in pieces)

    @property
    def sync(self):
        """This rank's end of the weight sync (``megarl.weight_sync.endpoints.SenderEndpoint``)."""
        if getattr(self, "_sync", None) is None:
            from megarl.weight_sync.endpoints import SenderEndpoint

            self._sync = SenderEndpoint(self.rank, self._local_shards)
        return self._sync

    def sync_sources(self) -> dict:
        return self.sync.sources()

    def sync_address(self) -> tuple[str, int]:
        return self.address_and_port()

    def sync_connect(self, plan, world_size: int, master_addr: str, master_port: int, transport: str,
                     timeout_s: float) -> None:
        self.sync.connect(plan, world_size, master_addr, master_port, transport, timeout_s)

    def sync_send(self, version: int) -> dict:
        self.enter_phase("sync")  # normally entered already, before the engines woke their weights
        return self.sync.send(version)

    def lora_adapter(self) -> dict | None:
        """The actor's adapter in PEFT format, on rank 0 (None on the others): adapter-only updates (collective)."""
        from megarl.trainer.lora_setup import adapter_update

        self.enter_phase("sync")
        chunks = [unwrap(m) for m in self.actor.model]
        return adapter_update(chunks, self.settings.actor_role.hf_path, self.layout, self.lora["actor"])

    def sync_close(self, dead_ranks: int = 0) -> None:
        self.sync.close(dead_ranks)


def named_weights(chunks) -> list[tuple[str, torch.Tensor]]:
    """Every parameter of a rank's model chunks, named as in the whole model: ``decoder.layers.<n>`` counts
    the layers of all pipeline stages (megatron numbers them within a stage)."""
    named = []
    for chunk in chunks:
        model = getattr(chunk, "module", chunk)
        layers = getattr(getattr(model, "decoder", None), "layers", None)
        for name, param in model.named_parameters():
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"] and layers is not None:
                parts[2] = str(layers[int(parts[2])].layer_number - 1)
            named.append((".".join(parts), param))
    return named


def dp_leaders(coords: list[dict[str, Any]]) -> list[int]:
    """For each data-parallel rank (in order), the index of one worker holding its results."""
    leaders: dict[int, int] = {}
    for index, c in enumerate(coords):
        leaders.setdefault(c["dp"], index)
    return [leaders[dp] for dp in sorted(leaders)]


def _to_host(result):
    """A compute method's tensors (or tuple of them, None kept) on the host: the driver has no GPU."""
    if isinstance(result, tuple):
        return tuple(_to_host(part) for part in result)
    return result.cpu() if result is not None else None


def gather_data_parallel(workers, leaders: list[int], method: str, *args) -> Any:
    """Call ``method`` on every rank; concatenate the data-parallel leaders' results in DP order.

    Every rank must take part (model-parallel collectives); a tuple result is concatenated field
    by field, with None fields kept as None.
    """
    results = workers.call(method, *args)
    picked = [results[i] for i in leaders]
    if isinstance(picked[0], tuple):
        return tuple(None if parts[0] is None else torch.cat(parts) for parts in zip(*picked))
    return torch.cat(picked)
