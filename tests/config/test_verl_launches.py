"""verl's 26 Megatron example launches through megarl's command line and every pre-flight check.

Each launch is verl's exact argv with ``verl`` replaced by ``megarl``; only paths and model ids are
rewritten, to local fixtures that stand for them: a model id becomes a directory whose config.json
has that model's architecture, a data file a parquet whose data source is that dataset's (as
verl's preprocessing writes it), a checkpoint a directory with a checkpoint's metadata file, and
the one absolute --config-path the directory holding verl's two configs it names. A launch must
either pass every check or fail only on refusals of features megarl does not have.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.checks import ConfigError, load_config
from megarl.config.command_line import parse_command_line
from megarl.models.published import PUBLISHED
from tests.config._fixtures import write_model_config, write_prompts

HERE = Path(__file__).parent / "verl_launches"
LAUNCHES = [json.loads(line) for line in (HERE / "megatron-example-launches.jsonl").read_text().splitlines()]
VALIDATED = 17  # docs/configuration.md and docs/coming-from-verl.md ("verl's launches") state this count

# model id (or path) -> (architecture, model_type, the dims of that model's config.json that the
# layout checks read: layers, heads, sizes and experts as published in the models' config.json)
QWEN2_7B = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                intermediate_size=18944, vocab_size=152064)
def _published(name: str) -> dict:
    """A published config.json's fields (bf16: verl's scripts point at dequantised copies)."""
    config = json.loads((PUBLISHED / name / "config.json").read_text())
    return {k: v for k, v in config.items() if k not in ("architectures", "model_type", "quantization_config")}


QWEN3_235B = _published("qwen3-235b-a22b")
QWEN3_30B = dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                 vocab_size=151936)
DEEPSEEK_V3 = _published("deepseek-v3")
MOONLIGHT = dict(hidden_size=2048, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
                 intermediate_size=11264, moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2,
                 num_experts_per_tok=6, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=None,
                 kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=163840,
                 routed_scaling_factor=2.446, scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True,
                 rope_theta=50000.0, max_position_embeddings=8192)
QWEN3_8B = dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=12288, vocab_size=151936)
QWEN3_32B = dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                 intermediate_size=25600, vocab_size=151936)


def _qwen3_vl_moe(text: dict) -> dict:
    """Qwen3-VL-MoE's config.json: the language model of the Qwen3-MoE of the same size (its layers, heads, experts
    and widths, as the two models publish them) with Qwen3-VL's M-RoPE, under ``text_config``; Qwen3-VL-8B's vision
    tower (27 blocks of 1152, DeepStack after blocks 8, 16, 24), its output the language model's width."""
    vl8b = _published("qwen3-vl-8b")
    rope = {"rope_type": "default", "rope_theta": 5000000, "mrope_section": [24, 20, 20], "mrope_interleaved": True}
    text = {**text, "model_type": "qwen3_vl_moe_text", "rope_scaling": rope, "max_position_embeddings": 262144,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    text.pop("rope_theta", None)
    vision = {**vl8b["vision_config"], "model_type": "qwen3_vl_moe", "out_hidden_size": text["hidden_size"]}
    return {**{k: v for k, v in vl8b.items() if k not in ("text_config", "vision_config")}, "text_config": text,
            "vision_config": vision}


QWEN3_VL_30B = _qwen3_vl_moe(QWEN3_30B)
QWEN3_VL_235B = _qwen3_vl_moe({k: v for k, v in QWEN3_235B.items() if k not in ("tie_word_embeddings",)})
MODELS = {
    "Qwen2": ("Qwen2ForCausalLM", "qwen2", QWEN2_7B),
    "Qwen2.5-3B": ("Qwen2ForCausalLM", "qwen2", dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
                                                     num_key_value_heads=2, intermediate_size=11008, vocab_size=151936)),
    "Qwen2.5-32B": ("Qwen2ForCausalLM", "qwen2", dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=40,
                                                      num_key_value_heads=8, intermediate_size=27648, vocab_size=152064)),
    "Qwen2.5-VL": ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", _published("qwen2.5-vl-7b")),
    "Qwen3-VL-30B": ("Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe", QWEN3_VL_30B),
    "Qwen3-VL-235B": ("Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe", QWEN3_VL_235B),
    "Qwen3-VL-8B": ("Qwen3VLForConditionalGeneration", "qwen3_vl", _published("qwen3-vl-8b")),
    "Qwen3-235B-A22B": ("Qwen3MoeForCausalLM", "qwen3_moe", QWEN3_235B),
    "Qwen3-30B-A3B": ("Qwen3MoeForCausalLM", "qwen3_moe", QWEN3_30B),
    "Qwen1.5-MoE": ("Qwen2MoeForCausalLM", "qwen2_moe", {}),
    "deepseek-llm-7b": ("LlamaForCausalLM", "llama", dict(hidden_size=4096, num_hidden_layers=30, num_attention_heads=32,
                                                          num_key_value_heads=32, intermediate_size=11008,
                                                          vocab_size=102400)),
    "DeepSeek-V3": ("DeepseekV3ForCausalLM", "deepseek_v3", DEEPSEEK_V3),
    "dsv3": ("DeepseekV3ForCausalLM", "deepseek_v3", DEEPSEEK_V3),
    "Moonlight": ("DeepseekV3ForCausalLM", "deepseek_v3", MOONLIGHT),
    # verl's August-2026 launches
    "Qwen3-8B": ("Qwen3ForCausalLM", "qwen3", QWEN3_8B),
    "Qwen3-32B": ("Qwen3ForCausalLM", "qwen3", QWEN3_32B),
    "Qwen3.5": ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", {}),
    "DeepSeek-V4": ("DeepseekV4ForCausalLM", "deepseek_v4", {}),
    "Hy3": ("HYV3ForCausalLM", "hy_v3", {}),
    "Nemotron-3-Nano": ("NemotronHForCausalLM", "nemotron_h", {}),
    "MiMo-7B": ("MiMoForCausalLM", "mimo", {}),
}
# dataset directory or file name -> the data_source verl's preprocessing writes
DATA_SOURCES = {"gsm8k": "openai/gsm8k", "math": "DigitalLearningGmbH/MATH-lighteval", "dapo-math": "math_dapo",
                "aime": "aime2024", "geo3k": "hiyouga/geometry3k"}


def _architecture(model: str, script: str) -> tuple[str, str, dict]:
    # Moonlight's PPO script leaves the path empty ($MODEL_PATH); its name says which model it is
    for name in sorted(MODELS, key=len, reverse=True):
        if name.lower() in (model or script).lower():
            return MODELS[name]
    raise AssertionError(f"no fixture architecture for model {model!r} of {script}")


class Fixtures:
    def __init__(self, root: Path):
        self.root = root
        self.made: dict[str, Path] = {}

    def model(self, value: str, script: str) -> str:
        key = f"model:{value or script}"
        if key not in self.made:
            architecture, model_type, dims = _architecture(value, script)
            self.made[key] = write_model_config(self.root / f"model{len(self.made)}", architecture, model_type, **dims)
        return str(self.made[key])

    def data(self, value: str) -> str:
        if key := self.made.get(f"data:{value}"):
            return str(key)
        source = next((s for name, s in DATA_SOURCES.items() if name in value), "openai/gsm8k")
        path = write_prompts(self.root / f"data{len(self.made)}.parquet", rows=1024, data_source=source)
        self.made[f"data:{value}"] = path
        return str(path)

    def checkpoint(self, value: str) -> str:
        from megarl.engine.checkpoint import META_FILE

        folder = self.root / "ckpt" / Path(value).name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / META_FILE).write_text("{}")
        return str(folder)


def rewrite(argv: list[str], fixtures: Fixtures, script: str, out: Path) -> list[str]:
    """The launch's arguments after ``-m verl.trainer.main_ppo``, with paths and model ids replaced."""
    args = []
    for arg in argv[2:]:
        key, eq, value = arg.partition("=")
        name = key.lstrip("+~")
        if key.startswith("--config-path") and value.startswith("/"):
            arg = f"{key}={HERE / 'config'}"
        elif name.endswith("model.path") or name.endswith("teacher_model.model_path"):
            arg = f"{key}={fixtures.model(value, script)}"
        elif name in ("data.train_files", "data.val_files"):
            files = [v.strip().strip("'\"") for v in value.strip("[]").split(",")] if value.startswith("[") else [value]
            paths = [fixtures.data(f or "gsm8k") for f in files]
            arg = f"{key}=[{','.join(paths)}]" if value.startswith("[") else f"{key}={paths[0]}"
        elif name.endswith("multi_turn.tool_config_path") and value:
            arg = f"{key}={HERE / 'tool_config' / Path(value).name}"
        elif name.endswith("dist_checkpointing_path") and value:
            arg = f"{key}={fixtures.checkpoint(value)}"
        elif name == "trainer.default_local_dir":
            arg = f"{key}={out}"
        args.append(arg)
    return args



def check_launch(launch: dict, fixtures: Fixtures, out: Path) -> tuple[list[str] | None, list[str]]:
    """One launch through megarl's command line and every pre-flight check: (None when it validates,
    else the refused features; the problems that are not refusals)."""
    script = launch["script"].rsplit("/", 1)[-1]
    assert launch["argv"][:2] == ["-m", "verl.trainer.main_ppo"]
    cmd = parse_command_line(rewrite(launch["argv"], fixtures, script, out))
    # the launches are for GPU nodes: whether they would fit this CPU host (megarl.plan.cpu_host) is not the point
    cmd.overrides.append("trainer.plan_check=False")
    try:
        load_config(cmd.name, cmd.overrides, config_path=cmd.config_path, preflight=True)
    except ConfigError as exc:
        return (sorted({f"{p.feature} ({'issue %d' % p.issue if p.issue else 'not planned'})" for p in exc.refusals}),
                [p.message for p in exc.problems if not p.is_refusal])
    return None, []


@pytest.fixture()
def wandb_installed(tmp_path, monkeypatch):
    """The launches log to wandb, which is not installed here: a package of that name stands for it
    (the check only looks for the package)."""
    stub = tmp_path / "site" / "wandb"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(stub.parent))


def test_every_verl_megatron_launch_validates_or_is_refused_for_a_missing_feature(tmp_path, monkeypatch, wandb_installed):
    monkeypatch.chdir(tmp_path)  # verl's relative --config-path=config then means the packaged configs
    fixtures = Fixtures(tmp_path / "fixtures")
    validated, refused, wrong = [], {}, {}
    for i, launch in enumerate(LAUNCHES):
        script = launch["script"].rsplit("/", 1)[-1]
        features, others = check_launch(launch, fixtures, tmp_path / f"run{i}")
        if others:
            wrong[script] = others
        if features is None:
            validated.append(script)
        else:
            refused[script] = features
    print(f"\n{len(validated)} of {len(LAUNCHES)} verl Megatron launches validate: {', '.join(validated)}")
    print("the others are refused for:")
    for script, features in refused.items():
        print(f"  {script}: {'; '.join(features)}")
    assert not wrong, "launches failing on something other than a missing feature:\n" + json.dumps(wrong, indent=1)
    with_cp = [launch["script"].rsplit("/", 1)[-1] for launch in LAUNCHES
               if any(a.split("=")[0].endswith("context_parallel_size") and a.split("=")[1] != "1" for a in launch["argv"])]
    assert len(with_cp) == 6 and "grpo_trainer_run_qwen3moe-30b_megatron_lora" in validated
    assert not any("context parallel" in feature and "vision-language" not in feature
                   for script in with_cp for feature in refused.get(script, []))
    assert len(validated) == VALIDATED, (f"{len(validated)} launches validate now: update VALIDATED, "
                                         "docs/configuration.md and docs/coming-from-verl.md")


def test_verls_fully_resolved_default_config_loads_as_a_yaml():
    """All of verl's ~600 default keys at verl's defaults: each is megarl's, another spelling, noted,
    or refused only when it asks for something (verl's defaults ask for nothing megarl lacks)."""
    notes: list[str] = []
    cfg = load_config("_generated_ppo_megatron_trainer", [
        "actor_rollout_ref.rollout.name=vllm",  # ??? in verl's defaults: verl requires it too
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4"],
        config_path=HERE / "config", notes=notes)
    assert cfg.actor_rollout_ref.rollout.logprobs_mode == "processed_logprobs"  # verl's value, honoured
    assert list(cfg.trainer.logger) == ["console", "wandb"] and cfg.data.filter_overlong_prompts is False
    assert any("use_mbridge" in note for note in notes) and any("data.seed=null" in note for note in notes)


# verl's newest Megatron example launches (verl-project/verl, August 2026; README.md in verl_launches/ says how
# they were taken): `model_engine=megatron`, verl's string thresholds, the new engine and checkpoint keys
LAUNCHES_2026 = [json.loads(line) for line in
                 (HERE / "megatron-example-launches-2026-08.jsonl").read_text().splitlines()]
# what megarl still reports that is not a refusal, by launch: each a setting of the example's own defaults that
# megarl's layout and optimizer checks reject (the test fails when one goes away, so the list stays true)
OTHER_PROBLEMS_2026 = {
    # optimizer_cpu_offload without use_precision_aware_optimizer (the DeepSeek-V3 launch sets both)
    "grpo_trainer/run_deepseek_v4_flash_megatron": ["optimizer_cpu_offload=True needs"],
    # expert_tensor_parallel_size unset is TP (verl's "null to be same as TP"): EP x ETP exceeds a pipeline stage,
    # which megatron-core's initialize_model_parallel rejects as well
    # and the rollout's expert_parallel_size is not TP x DP (64 with TP 8, 2 with TP 4), which verl's own RolloutConfig
    # asserts for vLLM as well (the second pairs it with moe_tensor_parallel_size=2, TensorRT-LLM's: refused)
    "grpo_trainer/run_qwen3_235b_a22b_megatron": ["expert_model_parallel_size x expert_tensor_parallel_size = 4 x 4",
                                                  "rollout.expert_parallel_size=64: vLLM's expert parallelism"],
    "grpo_trainer/run_qwen3_30b_a3b_megatron": ["expert_model_parallel_size x expert_tensor_parallel_size = 2 x 4",
                                                "rollout.expert_parallel_size=2: vLLM's expert parallelism"],
}


@pytest.fixture(scope="module")
def fixtures_2026(tmp_path_factory):
    return Fixtures(tmp_path_factory.mktemp("fixtures"))


@pytest.mark.parametrize("launch", LAUNCHES_2026, ids=[launch["script"].split("/", 1)[1] for launch in LAUNCHES_2026])
def test_verls_2026_megatron_launch_validates_or_is_refused_for_a_missing_feature(launch, fixtures_2026, tmp_path,
                                                                                  monkeypatch, wandb_installed):
    monkeypatch.chdir(tmp_path)
    assert launch["commit"] and launch["source"].endswith(".sh")
    features, others = check_launch(launch, fixtures_2026, tmp_path / "run")
    print(f"\n{launch['script']}: " + ("validates" if features is None else "refused for " + "; ".join(features)))
    expected = OTHER_PROBLEMS_2026.get(launch["script"].split("/", 1)[1], [])
    assert len(others) == len(expected) and all(any(e in o for o in others) for e in expected), others
    if features is not None:  # (or it fails only on the listed problems of its own settings)
        assert features or expected, "a failed launch names the features it asks for"


def test_verls_2026_launch_counts():
    """verl's August-2026 launches: each picks megatron by model_engine=megatron, or the deprecated ppo_megatron_trainer config, or strategy=megatron."""
    assert len(LAUNCHES_2026) == 29
    for launch in LAUNCHES_2026:
        argv = launch["argv"]
        assert ("model_engine=megatron" in argv or "--config-name=ppo_megatron_trainer.yaml" in argv
                or "actor_rollout_ref.actor.strategy=megatron" in argv), launch["script"]


def test_verls_2026_default_config_loads_as_a_yaml():
    """verl's August-2026 fully resolved Megatron config (the engine groups' new keys, the v1 trainer, the null deprecated reward_model section) at its defaults."""
    notes: list[str] = []
    cfg = load_config("_generated_ppo_megatron_trainer", [
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4"],
        config_path=HERE / "config-2026-08", notes=notes)
    assert cfg.async_training.mode == "sync"  # trainer.v1.trainer_mode=sync; the sampler's bounds stay inert
    assert cfg.reward_model.model.trust_remote_code is False  # null in verl's deprecated section: the default
    assert any("pad_to_length" in note for note in notes) and any("entropy" in note for note in notes)


# verl's Qwen3-VL-MoE launches (30B-A3B, 235B-A22B; January and August 2026): the bridge reads the model; what each
# still asks for that megarl lacks is context parallelism with M-RoPE and full recomputation with DeepStack features
QWEN3_VL_MOE_LAUNCHES = [launch for launch in LAUNCHES + LAUNCHES_2026
                         if any(size in launch["script"] for size in ("vl-30b", "vl-235b", "vl_30b", "vl_235b"))]
QWEN3_VL_MOE_REFUSALS = ["context parallelism for vision-language models (M-RoPE positions) (issue 28)",
                         "full activation recomputation with DeepStack features (Qwen3-VL) (issue 28)"]


def test_verls_qwen3_vl_moe_launches_are_refused_only_for_context_parallelism_and_full_recomputation(
        tmp_path, monkeypatch, wandb_installed):
    monkeypatch.chdir(tmp_path)
    from megarl.models import family_for, load_hf_config

    fixtures = Fixtures(tmp_path / "fixtures")
    assert len(QWEN3_VL_MOE_LAUNCHES) == 4
    for i, launch in enumerate(QWEN3_VL_MOE_LAUNCHES):
        assert check_launch(launch, fixtures, tmp_path / f"run{i}") == (QWEN3_VL_MOE_REFUSALS, []), launch["script"]
    for value in fixtures.made.values():
        if value.is_dir() and (value / "config.json").is_file():
            assert family_for(load_hf_config(value)).name == "qwen3_vl_moe"
    # without those two settings (CP 1, no recompute_* override) verl's August launches pass every check
    for i, launch in enumerate(QWEN3_VL_MOE_LAUNCHES[2:]):
        argv = [a.replace("context_parallel_size=2", "context_parallel_size=1") for a in launch["argv"] if "recompute_" not in a]
        assert check_launch({**launch, "argv": argv}, fixtures, tmp_path / f"cp1_{i}") == (None, []), launch["script"]
