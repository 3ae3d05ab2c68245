"""The planner on each 2026 family's largest published config.json (``megarl.models.published``).

Published totals (the tests' targets): gpt-oss-120b 116.8B total / 5.1B active (OpenAI's model card:
the active count leaves out the input embedding); GLM-4.5 355B / 32B (technical report, arXiv:2508.06471:
embedding and output layer left out, the multi-token-prediction layer counted); Qwen3-Next-80B-A3B
80B / 3B and Qwen3.5-397B-A17B 397B / 17B (Qwen's model cards; the 397B is the vision-language model,
the vision tower and the MTP layer not in the text config); Kimi-K2 1T / 32B (Moonshot's model card,
"1.04T" in its tech report); Gemma-2-27B 27.2B (Google's model card), Gemma-3-27B 27B (its text part:
the published checkpoint adds a ~0.4B SigLIP tower). The planner counts what the HF checkpoint holds
without MTP layers and vision towers, in bf16 (gpt-oss's MXFP4 experts and Kimi-K2's FP8 as
dequantised). All arithmetic: no process starts.
"""
import pytest

from megarl.checks import load_config
from megarl.models import load_hf_config
from megarl.models.published import PUBLISHED, match_published
from megarl.plan import gpu, plan_config
from megarl.plan.model import ModelFacts

A = "actor_rollout_ref.actor.megatron."


def facts(name: str) -> ModelFacts:
    return ModelFacts(load_hf_config(PUBLISHED / name))


def test_dense_gemma_counts_match_the_model_cards():
    gemma2, gemma3 = facts("gemma-2-27b"), facts("gemma-3-27b")
    assert (gemma2.family.name, gemma3.family.name) == ("gemma2", "gemma3")
    assert gemma2.hf_params == pytest.approx(27.2e9, rel=0.005) and gemma2.active_params == gemma2.hf_params
    assert gemma3.hf_params == pytest.approx(27.0e9, rel=0.005)  # the 27B's text_config (27.4B with its vision tower)
    assert gemma2.dims.tie_word_embeddings and gemma3.dims.tie_word_embeddings


@pytest.mark.parametrize("name, family, total, active, rel_total, rel_active", [
    # the embedding left out of the published active count (vocab x hidden, as OpenAI counts)
    ("gpt-oss-120b", "gpt_oss", 116.8e9, 5.13e9 + 201088 * 2880, 0.002, 0.005),
    # the technical report leaves out embedding and output (2 x 151552 x 5120) and counts the MTP layer (~3.9B)
    ("glm-4.5", "glm4_moe", 355e9 - 3.9e9 + 2 * 151552 * 5120, 32e9 + 2 * 151552 * 5120, 0.01, 0.02),
    ("qwen3-next-80b-a3b", "qwen3_next", 80e9, 3.9e9, 0.01, 0.02),  # "A3B": 3.25B without embedding and output
    ("qwen3.5-397b-a17b", "qwen3_5_moe", 397e9, 17e9, 0.005, 0.03),  # the text model: no vision tower, no MTP layer
    ("kimi-k2", "kimi_k2", 1.03e12, 32e9, 0.01, 0.03),
])
def test_moe_counts_match_the_published_totals_and_actives(name, family, total, active, rel_total, rel_active):
    model = facts(name)
    assert model.family.name == family
    assert model.hf_params == pytest.approx(total, rel=rel_total)
    assert model.active_params == pytest.approx(active, rel=rel_active)


def test_hub_ids_name_the_new_fixtures():
    for hub_id, name in [("google/gemma-2-27b", "gemma-2-27b"), ("google/gemma-3-27b-it", "gemma-3-27b"),
                         ("zai-org/GLM-4.5", "glm-4.5"),
                         ("Qwen/Qwen3-Next-80B-A3B-Instruct", "qwen3-next-80b-a3b"),
                         ("openai/gpt-oss-120b", "gpt-oss-120b"), ("/models/Kimi-K2-Instruct", "kimi-k2")]:
        assert match_published(hub_id) == PUBLISHED / name, hub_id
    assert match_published("acme/gemma-3-27bit") is None  # "it" ending a word is not the suffix


def layout(tp: int, pp: int, ep: int, first: int, last: int, rollout_tp: int, nodes: int = 8) -> list[str]:
    return [f"{A}tensor_model_parallel_size={tp}", f"{A}pipeline_model_parallel_size={pp}",
            f"{A}expert_model_parallel_size={ep}",
            f"{A}override_transformer_config.num_layers_in_first_pipeline_stage={first}",
            f"{A}override_transformer_config.num_layers_in_last_pipeline_stage={last}",
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout_tp}", f"trainer.nnodes={nodes}"]


# The Qwen3-235B recipe (8 GPUs a node, offloaded actor, full recompute) at a layout each model fits at;
# Kimi-K2 on the DeepSeek-V3 recipe (PP16, 4 + 14 x 4 + 1 layers) with twice its experts per EP group.
LAYOUTS = {
    "gemma-2-27b": ("grpo_qwen3_235b", layout(4, 2, 1, 23, 23, 4)),
    "gemma-3-27b": ("grpo_qwen3_235b", layout(4, 2, 1, 31, 31, 4)),
    "gpt-oss-120b": ("grpo_qwen3_235b", layout(4, 2, 8, 18, 18, 8)),
    "qwen3-next-80b-a3b": ("grpo_qwen3_235b", layout(2, 2, 16, 24, 24, 4)),  # 2 KV heads: TP2
    "glm-4.5": ("grpo_qwen3_235b", layout(4, 4, 32, 23, 23, 16, nodes=16)),
    "qwen3.5-397b-a17b": ("grpo_qwen3_235b", layout(2, 4, 64, 15, 15, 16, nodes=32)),
    "kimi-k2": ("grpo_moe_671b", [f"{A}expert_model_parallel_size=32", "trainer.nnodes=64",
                                  "actor_rollout_ref.rollout.tensor_model_parallel_size=64"]),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_planner_plans_each_familys_largest_published_config(name):
    recipe, overrides = LAYOUTS[name]
    cfg = load_config(f"configs/{recipe}.yaml", [f"actor_rollout_ref.model.path={PUBLISHED / name}", *overrides])
    plan = plan_config(cfg, gpu("h100"))
    assert plan.fits, [f.message for f in plan.findings]
