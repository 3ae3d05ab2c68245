"""The planner against published figures, the packaged configs, and layouts that cannot fit.

Sources (docs/planning.md): Meta's Llama-3.1-70B model card (70.6B parameters), DeepSeek-V3's
technical report (671B total, 37B activated per token), NeMo-RL's nccl_reshard refit design doc
(DeepSeek-V3 PP16 x EP16 -> TP32 x DP8 on H100 in 2.39-2.83 s, 97.6% of the bytes on the
shard-to-shard path). All arithmetic: no process starts.
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.models.published import PUBLISHED
from megarl.checks import load_config
from megarl.models import ParallelLayout, load_hf_config
from megarl.plan import Efficiency, gpu, plan_config
from megarl.plan.hardware import GB
from megarl.plan.model import ModelFacts, is_ffn_projection
from megarl.plan.report import config_comment
from megarl.plan.sync import SyncLayout, sync_traffic, traffic_from_plan

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = PUBLISHED
CONFIGS = {"grpo_70b": "llama-3.1-70b", "ppo_70b": "llama-3.1-70b", "grpo_qwen3_235b": "qwen3-235b-a22b",
           "grpo_moe_671b": "deepseek-v3"}


@pytest.fixture(scope="module")
def deepseek():
    return ModelFacts(load_hf_config(FIXTURES / "deepseek-v3"))


def config(name: str, *overrides: str):
    return load_config(f"configs/{name}.yaml", [f"actor_rollout_ref.model.path={FIXTURES / CONFIGS[name]}", *overrides])


def test_parameter_counts_match_the_published_ones(deepseek):
    llama = ModelFacts(load_hf_config(FIXTURES / "llama-3.1-70b"))
    assert llama.hf_params == pytest.approx(70.6e9, rel=0.005) and llama.active_params == llama.hf_params
    assert deepseek.hf_params == pytest.approx(671e9, rel=0.005)  # without the multi-token-prediction layer
    assert deepseek.active_params == pytest.approx(37e9, rel=0.02)


def test_deepseek_v3_sync_moves_its_bf16_bytes_once(deepseek):
    """1.34 TB in bf16 (+ the fp32 router biases) leave the trainer, each byte once; NeMo-RL's 97.6% FFN share."""
    layout = ParallelLayout(pp=16, ep=16, first_stage_layers=4, last_stage_layers=1)
    sync = SyncLayout(tuple(range(256)), tuple(tuple(range(32 * i, 32 * i + 32)) for i in range(8)), 8)
    traffic = sync_traffic(deepseek, layout, sync)
    expected = sum(math.prod(s) * (4 if n in deepseek.fp32_tensors else 2) for n, s in deepseek.hf_shapes.items())
    assert traffic.bytes_sent == expected == pytest.approx(1.342e12, rel=1e-3)
    ffn = sum(math.prod(s) * 2 for n, s in deepseek.hf_shapes.items() if is_ffn_projection(n))
    assert ffn / expected == pytest.approx(0.976, abs=0.001)


def test_nemo_rl_refit_time_is_reproduced_within_2x(deepseek):
    """Their layout (split: 256 trainer GPUs, 8 TP32 replicas on 256 more) and protocol (FFN shard to
    shard, the rest broadcast whole from one rank after it), H100 default figures."""
    layout = ParallelLayout(pp=16, ep=16, first_stage_layers=4, last_stage_layers=1)
    sync = SyncLayout(tuple(range(256)), tuple(tuple(range(256 + 32 * i, 288 + 32 * i)) for i in range(8)), 8)
    h100, eff = gpu("h100"), Efficiency()
    ib, nvlink = h100.ib_gbps * GB * eff.link, h100.nvlink_gbps * GB * eff.link
    nemo = sync_traffic(deepseek, layout, sync, protocol="nemo_rl").seconds(ib, nvlink)
    assert 2.83 / 2 <= nemo <= 2.39 * 2, nemo
    megarl = sync_traffic(deepseek, layout, sync).seconds(ib, nvlink)
    assert megarl < nemo  # every tensor shard to shard: no whole-tensor broadcast of the other 2.4%


def test_sync_traffic_equals_the_sync_planners():
    """The per-GPU link bytes from tensor kinds equal those of the planner's real buckets."""
    from megarl.weight_sync.layouts import plan_for_layouts
    from megarl.weight_sync.rollout_layout import RolloutLayout

    llama = ModelFacts(load_hf_config(FIXTURES / "llama-3.1-70b"))
    layout = ParallelLayout(tp=8, pp=2)
    sync = SyncLayout(tuple(range(64)), tuple(tuple(range(8 * i, 8 * i + 8)) for i in range(8)), 8)
    ours = sync_traffic(llama, layout, sync)
    plan = plan_for_layouts(llama.hf_config, layout, 64, RolloutLayout(8, 8, "shard", first_rank=64))
    theirs = traffic_from_plan(plan, sync)
    assert (ours.bytes_sent, ours.bytes_delivered) == (theirs.bytes_sent, theirs.bytes_delivered)
    for rank in range(128):
        a, b = ours.per_rank[rank], theirs.per_rank[rank]
        assert a.ib_in + a.nvlink_in == pytest.approx(b.ib_in + b.nvlink_in, rel=1e-9), rank  # what each receives
        assert a.ib_out == pytest.approx(b.ib_out, rel=0.01), rank  # each source's share, the planner balances
    eff = Efficiency()
    ib, nvlink = 50 * GB * eff.link, 450 * GB * eff.link
    assert ours.seconds(ib, nvlink) == pytest.approx(theirs.seconds(ib, nvlink), rel=0.01)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_packaged_configs_fit_and_carry_the_planners_output(name):
    plan = plan_config(config(name), gpu("h100"))
    assert plan.fits, [f.message for f in plan.findings]
    text = (ROOT / "configs" / f"{name}.yaml").read_text()
    block = "\n".join(config_comment(plan, f"configs/{name}.yaml"))
    assert block in text, f"configs/{name}.yaml's memory plan is stale; paste `megarl plan configs/{name}.yaml --comment`:\n{block}"


def test_70b_at_tp1_on_80gb_is_flagged_with_the_keys_to_change():
    cfg = config("grpo_70b", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                 "actor_rollout_ref.actor.megatron.sequence_parallel=false")
    plan = plan_config(cfg, gpu("h100"))
    assert not plan.fits
    update = next(f for f in plan.findings if f.where == "update_actor")
    assert update.message.startswith("update_actor: each GPU needs 30") and "actor grads 141.1 GB" in update.message
    assert not update.fixes  # no one key saves 225 GB
    assert "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2" in update.helps
    assert "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=4" in update.helps
    assert update.together == ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=8",)
    assert plan_config(config("grpo_70b"), gpu("h100")).fits  # TP8 x PP2, as packaged


def test_validation_refuses_an_impossible_run_on_a_gpu_machine(monkeypatch):
    from megarl.plan import check, hardware

    cfg = config("grpo_70b", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                 "actor_rollout_ref.actor.megatron.sequence_parallel=false")
    monkeypatch.setattr(hardware, "local_gpu", lambda: None)
    assert check.plan_problems(cfg) == []  # no GPU here: nothing to check against
    monkeypatch.setattr(hardware, "local_gpu", lambda: gpu("h100"))
    problems = check.plan_problems(cfg)
    assert problems and all(p.key == "trainer.plan_check" for p in problems)
    assert "does not fit on h100" in problems[0].message and "tensor_model_parallel_size=" in " ".join(map(str, problems))
    from megarl.checks.preflight import preflight_problems

    assert any("does not fit on h100" in p.message for p in preflight_problems(cfg))  # what a launch runs
    cfg.trainer.plan_check = False
    assert check.plan_problems(cfg) == []
    assert check.plan_problems(config("grpo_70b")) == []


@pytest.mark.heavy  # starts a process
def test_the_command_prints_json_and_exits_by_fit(capsys):
    from megarl.run.plan_command import main

    model = f"actor_rollout_ref.model.path={FIXTURES / 'llama-3.1-70b'}"
    done = subprocess.run([sys.executable, "-m", "megarl.run.cli", "plan", "configs/grpo_70b.yaml", model, "--gpu", "h200",
                           "--mfu", "0.4", "--json"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["hardware"]["memory_gb"] == 141 and data["efficiency"]["mfu"] == 0.4 and data["fits"]
    assert {p["phase"] for p in data["phases"]} == {"generate", "log_prob", "ref", "update_actor", "sync"}
    assert main([str(ROOT / "configs/grpo_70b.yaml"), model, "--memory-gb", "40"]) == 1
    out = capsys.readouterr().out
    assert "hardware: h100*: 40 GB" in out and "DOES NOT FIT" in out and "makes it fit" in out
    assert main([str(ROOT / "configs/grpo_70b.yaml"), model, "--gpu", "v100"]) == 2
    assert "unknown GPU 'v100'" in capsys.readouterr().err


def test_context_parallelism_halves_the_update_activations_per_rank():
    """The 70B config at CP2 on the same 64 GPUs (so DP halves): each rank holds half of every sequence,
    so the update's activations per rank halve (as the logits' share); the layout line shows CP2."""
    cp1, cp2 = (plan_config(config("grpo_70b", f"actor_rollout_ref.actor.megatron.context_parallel_size={cp}"),
                            gpu("h100")) for cp in (1, 2))
    assert cp2.inputs.dp * 2 == cp1.inputs.dp
    actor1, actor2 = cp1.memory.roles["actor"], cp2.memory.roles["actor"]
    assert 0.45 <= actor2.activations / actor1.activations <= 0.55 and actor2.logits < actor1.logits
    from megarl.plan.report import render

    assert " x CP2 x DP2 + SP" in render(cp2)


def test_packing_saves_tokens_on_long_tailed_lengths(capsys):
    """Responses log-normal around a median of 128 (cut at 1024): a token budget of real tokens computes
    fewer tokens than padded micro-batches, never above the budget x CP; equal lengths save nothing."""
    from megarl.engine.settings import BatchSettings
    from megarl.run.plan_command import main
    from megarl.plan.packing import Lengths, pass_packing

    budget = BatchSettings(use_dynamic_bsz=True, max_token_len=8192)
    skewed = pass_packing("update", budget, 64, Lengths(prompt=64, median=128, cap=1024), cp=2)
    assert skewed.ratio > 1.3 and skewed.largest_packed <= 2 * 8192
    equal = pass_packing("update", BatchSettings(micro_batch_size=8), 64, Lengths(64, 512, 512, sigma=0.0), cp=1)
    assert equal.ratio == 1.0 and equal.real_tokens == 64 * 576
    model = f"actor_rollout_ref.model.path={FIXTURES / 'llama-3.1-70b'}"
    assert main([str(ROOT / "configs/grpo_70b.yaml"), model, "--response-length-median", "200"]) == 0
    out = capsys.readouterr().out
    assert "sequence packing, per rank and step, at responses log-normal around a median of 200 tokens" in out
    assert "actor update" in out and "this run: packed" in out
