"""The rollout config -> sampling / engine mapping, checked against hand-written expectations (no engines)."""
import pytest

from megarl.config.schema import RolloutConfig, SamplingOverrides
from megarl.rollout.vllm.engine_config import (WORKER_EXTENSION, cpu_kv_cache_bytes, llm_kwargs, replica_env, replica_spec,
                                               resolve_dtype)
from megarl.rollout.fleet import split_evenly
from megarl.rollout.sampling import request_seed, resolve_sampling


def rollout_config(**changes) -> RolloutConfig:
    values = dict(prompt_length=32, response_length=16)
    values.update(changes)
    return RolloutConfig(**values)


def test_training_sampling_comes_from_the_rollout_keys():
    config = rollout_config(n=4, temperature=0.7, top_p=0.9, top_k=20, stop=["</answer>"])
    sampling = resolve_sampling(config)
    assert (sampling.n, sampling.temperature, sampling.top_p, sampling.top_k) == (4, 0.7, 0.9, 20)
    assert sampling.max_tokens == 16 and sampling.stop == ("</answer>",) and not sampling.greedy
    kwargs = sampling.engine_kwargs()
    assert kwargs["max_tokens"] == 16 and kwargs["logprobs"] == 0 and kwargs["stop"] == ["</answer>"]
    assert "seed" not in kwargs  # set per request by the replica


def test_validation_sampling_uses_val_kwargs_and_is_greedy_by_default():
    config = rollout_config(n=8, temperature=1.0)
    sampling = resolve_sampling(config, validate=True)
    assert sampling.greedy and sampling.n == 1 and sampling.top_k == -1 and sampling.top_p == 1.0
    sampled = resolve_sampling(rollout_config(val_kwargs=SamplingOverrides(n=2, do_sample=True, temperature=0.6)),
                               validate=True)
    assert (sampled.n, sampled.temperature, sampled.greedy) == (2, 0.6, False)


def test_overrides_and_n_win_and_do_sample_false_means_greedy():
    config = rollout_config(n=2, temperature=1.0, top_k=5)
    sampling = resolve_sampling(config, {"max_tokens": 3, "stop": "x", "do_sample": False}, n=5)
    assert (sampling.n, sampling.max_tokens, sampling.stop, sampling.temperature, sampling.top_k) == (5, 3, ("x",), 0.0, -1)
    assert resolve_sampling(config, {"response_length": 7}).max_tokens == 7


def test_unknown_or_bad_sampling_values_are_rejected_with_the_fix():
    with pytest.raises(ValueError, match=r"unknown sampling key 'temprature' \(did you mean 'temperature'\?\)"):
        resolve_sampling(rollout_config(), {"temprature": 0.5})
    with pytest.raises(ValueError, match="top_p=0 must be in"):
        resolve_sampling(rollout_config(), {"top_p": 0})
    with pytest.raises(ValueError, match="n=0 must be an integer >= 1"):
        resolve_sampling(rollout_config(), n=0)
    with pytest.raises(ValueError, match="must be a list of non-empty strings"):
        resolve_sampling(rollout_config(), {"stop": [""]})


def test_request_seeds_are_stable_distinct_and_in_range():
    seeds = {request_seed(0, step, i) for step in range(5) for i in range(200)}
    assert len(seeds) == 1000  # no collisions among 1000 (step, prompt) pairs
    assert all(0 <= s < 2**31 for s in seeds)
    assert request_seed(0, 3, 7) == request_seed(0, 3, 7) != request_seed(1, 3, 7)


@pytest.mark.parametrize("count,parts,sizes", [(7, 3, [3, 2, 2]), (2, 2, [1, 1]), (1, 3, [1, 0, 0]), (6, 2, [3, 3])])
def test_split_evenly_gives_contiguous_balanced_chunks(count, parts, sizes):
    chunks = split_evenly(count, parts)
    assert [len(c) for c in chunks] == sizes
    assert [i for c in chunks for i in c] == list(range(count))


def test_engine_arguments_on_cpu(monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    config = rollout_config(tensor_model_parallel_size=1, max_num_seqs=8, seed=3, enforce_eager=True)
    spec = replica_spec(config, "/models/x", use_gpu=False, cpus_per_replica=2, cpu_kv_cache_gib=0.5)
    kwargs = llm_kwargs(spec, on_gpu=False)
    assert kwargs["model"] == kwargs["tokenizer"] == "/models/x"
    assert kwargs["dtype"] == "float32" and kwargs["max_model_len"] == 32 + 16  # verl: prompt + response
    assert kwargs["distributed_executor_backend"] == "uni" and kwargs["kv_cache_memory_bytes"] == 512 * 2**20
    assert kwargs["worker_extension_cls"] == WORKER_EXTENSION and kwargs["seed"] == 3 and kwargs["max_num_seqs"] == 8
    assert "gpu_memory_utilization" not in kwargs and "enable_sleep_mode" not in kwargs
    env = replica_env(spec, on_gpu=False)
    assert env["OMP_NUM_THREADS"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert env["TORCHDYNAMO_DISABLE"] == "1"  # eager on CPU: vLLM's compiled sampler helpers run eager
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # TP=1 on CPU: engine core and worker in the replica
    tp2 = replica_spec(rollout_config(tensor_model_parallel_size=2), "/models/x", use_gpu=False)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in replica_env(tp2, on_gpu=False)  # TP workers need "mp"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # set by the user: passed on to the replicas
    assert replica_env(spec, on_gpu=False)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert replica_env(tp2, on_gpu=False)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    compiled = replica_spec(rollout_config(enforce_eager=False), "/models/x", use_gpu=False)
    assert "TORCHDYNAMO_DISABLE" not in replica_env(compiled, on_gpu=False)


def test_engine_arguments_on_gpu_with_tp():
    config = rollout_config(tensor_model_parallel_size=4, gpu_memory_utilization=0.6, max_model_len=4096)
    spec = replica_spec(config, "/models/x", use_gpu=True, tokenizer_path="/tok")
    kwargs = llm_kwargs(spec, on_gpu=True)
    assert kwargs["tensor_parallel_size"] == 4 and kwargs["distributed_executor_backend"] == "mp"
    assert kwargs["dtype"] == "bfloat16" and kwargs["max_model_len"] == 4096 and kwargs["tokenizer"] == "/tok"
    assert kwargs["gpu_memory_utilization"] == 0.6 and kwargs["enable_sleep_mode"] is True  # free_cache_engine default
    assert "kv_cache_memory_bytes" not in kwargs and "OMP_NUM_THREADS" not in replica_env(spec, on_gpu=True)
    assert "TORCHDYNAMO_DISABLE" not in replica_env(spec, on_gpu=True)  # GPU: vLLM compiles as it chooses
    gpu_tp1 = replica_spec(rollout_config(), "/models/x", use_gpu=True)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in replica_env(gpu_tp1, on_gpu=True)  # vLLM's own choice on GPU
    assert replica_spec(rollout_config(free_cache_engine=True), "m", use_gpu=False).enable_sleep_mode is False
    assert resolve_dtype("float16", on_gpu=True) == "float16"


def test_split_placement_turns_sleep_off_and_node_spanning_tp_uses_the_ray_executor():
    config = rollout_config(tensor_model_parallel_size=32)
    assert replica_spec(config, "m", use_gpu=True, sleep_mode=False).enable_sleep_mode is False
    spec = replica_spec(config, "m", use_gpu=True, ray_executor=True)
    assert llm_kwargs(spec, on_gpu=True)["distributed_executor_backend"] == "ray"


def test_deepseek_v3_gets_its_routing_fields_and_cpu_mla_backend():
    """vLLM routes DeepSeek-V3 by topk_method/scoring_func (transformers drops them): they are always given;
    on CPU in fp32 the MLA engine needs the reference CPU_MLA backend (the AMX one takes bf16 only)."""
    from megarl.models import uses_mla, vllm_hf_overrides
    from megarl.devtools.tiny_model import build_config

    deepseek, llama = build_config("deepseek_v3", "tiny"), build_config("llama", "tiny")
    assert vllm_hf_overrides(deepseek) == {"topk_method": "noaux_tc", "scoring_func": "sigmoid"} and uses_mla(deepseek)
    assert vllm_hf_overrides(llama) == {} and not uses_mla(llama)
    config = rollout_config()
    spec = replica_spec(config, "m", use_gpu=False, hf_overrides=vllm_hf_overrides(deepseek), mla=True)
    cpu = llm_kwargs(spec, on_gpu=False)
    assert cpu["hf_overrides"] == {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    assert cpu["attention_config"] == {"backend": "CPU_MLA"}
    gpu = llm_kwargs(replica_spec(config, "m", use_gpu=True, hf_overrides=vllm_hf_overrides(deepseek), mla=True), on_gpu=True)
    assert "attention_config" not in gpu and gpu["hf_overrides"]["scoring_func"] == "sigmoid"
    plain = llm_kwargs(replica_spec(config, "m", use_gpu=False), on_gpu=False)
    assert "hf_overrides" not in plain and "attention_config" not in plain


def test_uninterpolated_lengths_give_a_clear_error():
    with pytest.raises(ValueError, match="rollout.prompt_length='\\$\\{data.max_prompt_length\\}' is not an integer"):
        replica_spec(RolloutConfig(), "m", use_gpu=False)


def test_the_rollout_node_of_a_full_megarl_config_works_as_is():
    from omegaconf import OmegaConf

    from megarl.config.schema import MegaRLConfig

    config = OmegaConf.structured(MegaRLConfig)
    config.data.max_prompt_length, config.data.max_response_length = 100, 28
    config.actor_rollout_ref.rollout.stop = ["</answer>"]
    rollout = config.actor_rollout_ref.rollout
    assert replica_spec(rollout, "m", use_gpu=False).max_model_len == 128
    sampling = resolve_sampling(rollout, {"stop": OmegaConf.create(["a", "b"])})
    assert sampling.max_tokens == 28 and sampling.stop == ("a", "b")
    assert resolve_sampling(rollout).stop == ("</answer>",)


def test_verl_rollout_keys_reach_the_engine_arguments():
    from megarl.config.schema import EngineKwargsConfig

    config = rollout_config(enable_prefix_caching=False, logprobs_mode="processed_logprobs", scheduling_policy="priority",
                            disable_log_stats=False, ignore_eos=True,
                            engine_kwargs=EngineKwargsConfig(vllm={"max_logprobs": 7, "disable_mm_preprocessor_cache": True}))
    kwargs = llm_kwargs(replica_spec(config, "/m", use_gpu=True), on_gpu=True)
    assert (kwargs["enable_prefix_caching"], kwargs["logprobs_mode"], kwargs["scheduling_policy"],
            kwargs["disable_log_stats"]) == (False, "processed_logprobs", "priority", False)
    assert kwargs["max_logprobs"] == 7  # rollout.engine_kwargs.vllm, passed through
    assert kwargs["mm_processor_cache_gb"] == 0 and "disable_mm_preprocessor_cache" not in kwargs  # vLLM's rename
    assert resolve_sampling(config).ignore_eos and resolve_sampling(config, validate=True).ignore_eos


@pytest.mark.heavy  # starts a process
def test_engine_kwargs_are_checked_against_vllms_engine_args():
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    from megarl.rollout.vllm.engine_config import engine_kwargs_problems, vllm_engine_arg_names

    assert vllm_engine_arg_names() == {f.name for f in dataclasses.fields(EngineArgs)}  # read without importing vLLM
    problems = engine_kwargs_problems({"max_logprob": 5, "tensor_parallel_size": 4, "kv_cache_dtype": "fp8"})
    assert len(problems) == 2
    assert problems[0].startswith("actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprob is not an engine argument of "
                                  "the installed vLLM (vllm.EngineArgs); did you mean max_logprobs")
    assert problems[1] == ("actor_rollout_ref.rollout.engine_kwargs.vllm.tensor_parallel_size: megarl sets this engine "
                           "argument from actor_rollout_ref.rollout.tensor_model_parallel_size; set that instead")


def test_expert_parallel_size_is_vllms_expert_parallelism_on_gpu_and_refused_on_cpu():
    ep = rollout_config(tensor_model_parallel_size=4, expert_parallel_size=4)
    kwargs = llm_kwargs(replica_spec(ep, "m", use_gpu=True), on_gpu=True)
    assert kwargs["enable_expert_parallel"] is True and kwargs["expert_placement_strategy"] == "linear"
    assert "enable_expert_parallel" not in llm_kwargs(replica_spec(rollout_config(tensor_model_parallel_size=4), "m",
                                                                   use_gpu=True), on_gpu=True)
    with pytest.raises(ValueError, match="SIGSEGV in cpu_fused_moe"):
        replica_spec(ep, "m", use_gpu=False)
    with pytest.raises(ValueError, match=r"expert_parallel_size=8: .* it is 1 .* or 4"):
        replica_spec(rollout_config(tensor_model_parallel_size=4, expert_parallel_size=8), "m", use_gpu=True)
    with pytest.raises(ValueError, match="data_parallel_size=2: data parallelism inside one rollout engine"):
        replica_spec(rollout_config(tensor_model_parallel_size=2, data_parallel_size=2, expert_parallel_size=4), "m",
                     use_gpu=True)


@pytest.mark.parametrize("key", ["enable_expert_parallel", "expert_placement_strategy", "enable_eplb"])
def test_expert_placement_engine_arguments_are_megarls(key):
    from megarl.rollout.vllm.engine_config import engine_kwargs_problems

    (problem,) = engine_kwargs_problems({key: True})
    assert "megarl sets this engine argument" in problem


MIB = 1 << 20


@pytest.mark.parametrize("seqs,length,per_token,expected", [
    (1024, 56, 2048, 1024 * 56 * 2048),  # what 1024 sequences of 56 tokens at 2 KiB a token need (112 MiB)
    (8, 48, 2048, 64 * MIB),  # less than 64 MiB: 64 MiB
    (1024, 4096, 46080, 1024 * MIB),  # SmolLM2-sized sequences: capped at 1 GiB (host RAM is shared)
    (1024, 56, None, 1024 * MIB),  # a model without a megarl family: 1 GiB
])
def test_a_cpu_engine_s_kv_cache_holds_what_its_sequences_need_within_64_mib_and_1_gib(seqs, length, per_token, expected):
    assert cpu_kv_cache_bytes(seqs, length, per_token) == expected


def test_the_cpu_kv_cache_follows_max_num_seqs_and_the_model_unless_given(tmp_path):
    from megarl.devtools.tiny_model import make_tiny_model
    from megarl.models import model_dims
    from megarl.rollout.backend import ReplicaRequest
    from megarl.rollout.vllm.registration import spec_for

    model = make_tiny_model("llama", "tiny", tmp_path / "llama", seed=0)
    dims = model_dims(model)
    per_token = 2 * dims.num_layers * dims.attention.num_query_groups * dims.attention.head_dim * 4  # K, V in fp32
    config = rollout_config(tensor_model_parallel_size=1, max_num_seqs=512, prompt_length=200, response_length=56)
    spec = spec_for(ReplicaRequest(config, str(model), use_gpu=False))
    assert spec.cpu_kv_cache_bytes == 512 * 256 * per_token > 64 * MIB, (per_token, spec)
    assert spec_for(ReplicaRequest(config, str(model), use_gpu=False, cpu_kv_cache_gib=0.25)).cpu_kv_cache_bytes == 256 * MIB
