"""LoRA on the Megatron engine: one torchrun launch (2 ranks, gloo) of ``_lora_worker.py``, checked here.

Independent references: Hugging Face transformers with PEFT loading the adapter megarl exported
(Llama), transformers on the merged export (MoE, MLA: transformers 5 fuses MoE experts, which PEFT
cannot adapt), and the merge computed here from the exported PEFT tensors and the original
safetensors with PEFT's documented math (``W + lora_alpha / r * B @ A`` per projection).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from tests.ports import run_ranks, torchrun
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
import _engine_data as _data  # noqa: E402
import _engine_hf as _hf  # noqa: E402
import _lora_worker as _worker  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]
TOL = 1e-5
SCALE = _worker.KAIMING_B.scale


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    from megarl.devtools.tiny_model import make_tiny_model

    work = tmp_path_factory.mktemp("lora")
    for family in (_worker.LLAMA, _worker.MOE, _worker.MLA):
        make_tiny_model(family, "tiny", work / family, seed=0)
    batches = {}
    for model in (_worker.LLAMA, _worker.MOE, _worker.MLA):
        batch = _data.base_batch(0)
        batches[model] = _data.with_behaviour_log_probs(batch, _hf.hf_log_probs(work / model, batch)[0])
    second = _data.base_batch(1)
    batches["second"] = _data.with_behaviour_log_probs(second, _hf.hf_log_probs(work / _worker.LLAMA, second)[0], seed=2)
    torch.save(batches, work / "lora_batch.pt")
    write_peft_adapter(work / _worker.LLAMA, work / "peft_any", _worker.PEFT_ANY)
    return work


def write_peft_adapter(model_dir: Path, out: Path, settings) -> None:
    """An adapter as PEFT itself makes one: every projection its own random A and B (not megarl's export)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(11)
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, target_modules=list(settings.target_modules),
                        init_lora_weights=False)  # B random too: the adapter changes the model
    get_peft_model(_hf.load_causal_lm(model_dir), config).save_pretrained(str(out))


def peft_model_log_probs(work: Path, adapter: Path, batch_name: str = "llama") -> torch.Tensor:
    from peft import PeftModel

    model = PeftModel.from_pretrained(_hf.load_causal_lm(work / "llama"), str(adapter)).eval()
    batch = torch.load(work / "lora_batch.pt", weights_only=False)[batch_name]
    with torch.no_grad():
        return _hf.log_probs_and_entropy(_hf.response_outputs(model, batch), batch)[0]


@pytest.fixture(scope="module")
def results(work) -> dict:
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo))
    command = [*torchrun(2), str(Path(__file__).with_name("_lora_worker.py")), str(work)]
    done = run_ranks(command, env=env, timeout=850)
    assert done.returncode == 0, f"torchrun failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-8000:]}"
    return torch.load(work / "lora.pt", weights_only=False)


def original(work: Path, model: str) -> dict[str, torch.Tensor]:
    return load_file(str(work / model / "model.safetensors"))


def peft_merge(base: dict, peft: dict, scale: float) -> dict:
    """PEFT's math: each adapted projection's weight plus scale * B @ A, computed here from the PEFT tensors."""
    merged = dict(base)
    for name, a in peft.items():
        if ".lora_A." not in name:
            continue
        module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b = peft[name.replace(".lora_A.", ".lora_B.")]
        merged[f"{module}.weight"] = base[f"{module}.weight"] + scale * b.double().matmul(a.double()).float()
    return merged


def close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> bool:
    return (a - b).abs().max().item() <= tol


def test_every_layout_gives_the_tp1_log_probs(results):
    forward = results["forward"]
    for key in forward:
        model, label, layout = key.rsplit("/", 2) if key.count("/") == 2 else (None, None, None)
        if model is None or layout == "tp1":
            continue
        reference = forward[f"{model}/{label}/tp1"]
        for name in ("log_probs", "entropy"):
            assert close(forward[key][name], reference[name]), (key, name, (forward[key][name] - reference[name]).abs().max())


def test_adapters_are_the_same_under_every_layout(results):
    """Initialised in HF coordinates: every layout starts from the same adapter, and exports it whole."""
    forward = results["forward"]
    for key, record in forward.items():
        if key.count("/") != 2 or key.endswith("/tp1"):
            continue
        reference = forward[key.rsplit("/", 1)[0] + "/tp1"]["peft"]
        assert sorted(record["peft"]) == sorted(reference)
        for name, tensor in record["peft"].items():
            assert torch.equal(tensor, reference[name]), (key, name)


def test_hf_with_peft_loading_the_exported_adapter_gives_the_engine_log_probs(work, results, tmp_path):
    from peft import PeftModel

    from megarl.models.lora.peft import ADAPTER_CONFIG, peft_config
    import json

    for label, settings in (("kaiming_b", _worker.KAIMING_B), ("subset", _worker.SUBSET),
                            ("canonical", _worker.CANONICAL)):
        record = results["forward"][f"llama/{label}/tp2_sp"]  # q/k/v split from TP2 shards of fused QKV under GQA
        adapter = tmp_path / label
        adapter.mkdir()
        save_file(record["peft"], str(adapter / "adapter_model.safetensors"))
        (adapter / ADAPTER_CONFIG).write_text(json.dumps(peft_config(settings, work / "llama", work / "llama")))
        model = PeftModel.from_pretrained(_hf.load_causal_lm(work / "llama"), str(adapter)).eval()
        batch = torch.load(work / "lora_batch.pt", weights_only=False)["llama"]
        with torch.no_grad():
            log_probs, entropy = _hf.log_probs_and_entropy(_hf.response_outputs(model, batch), batch)
        assert close(log_probs, record["log_probs"]) and close(entropy, record["entropy"]), label


def test_the_merged_export_is_w_plus_scale_b_a(work, results):
    """W + alpha/r * B A, from the exported PEFT tensors (per projection) and the original weights, for
    every model and layout: the q/k/v and gate/up split of the adapter matches the weight's."""
    for key, record in results["forward"].items():
        if key.count("/") != 2:
            continue
        model = key.split("/")[0]
        expected = peft_merge(original(work, model), record["peft"], SCALE)
        assert set(record["merged"]) <= set(expected), key  # DeepSeek-V3's MTP layer is not exported
        for name, tensor in record["merged"].items():
            assert close(tensor, expected[name], 1e-6), (key, name)


def test_hf_on_the_merged_export_gives_the_engine_log_probs(work, results, tmp_path):
    from transformers import AutoModelForCausalLM

    batches = torch.load(work / "lora_batch.pt", weights_only=False)
    for key in ("qwen3_moe/kaiming_b/ep2", "deepseek_v3/all_linear/tp2_sp", "llama/kaiming_b/pp2"):
        model_name = key.split("/")[0]
        model = AutoModelForCausalLM.from_pretrained(str(work / model_name), dtype=torch.float32)
        out = tmp_path / key.replace("/", "_")
        model.save_pretrained(str(out))
        merged = {**original(work, model_name), **results["forward"][key]["merged"]}
        for f in out.glob("*.safetensors"):
            f.unlink()
        save_file(merged, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "model.safetensors.index.json").unlink(missing_ok=True)
        log_probs, _ = _hf.hf_log_probs(out, batches[model_name])
        assert close(log_probs, results["forward"][key]["log_probs"]), key


def test_a_subset_of_a_fused_linear_adapts_exactly_those_projections(work, results):
    record = results["forward"]["llama/subset/tp2_sp"]
    adapted = {n.removeprefix("base_model.model.").removesuffix(".lora_A.weight").rsplit(".", 1)[-1]
               for n in record["peft"] if ".lora_A." in n}
    assert adapted == {"q_proj", "v_proj", "gate_proj", "o_proj"}
    base = original(work, "llama")
    for name, tensor in record["merged"].items():  # k_proj, up_proj and down_proj are not touched at all
        if any(p in name for p in ("k_proj", "up_proj", "down_proj")):
            assert torch.equal(tensor, base[name]), name
        elif any(p in name for p in adapted):
            assert not torch.equal(tensor, base[name]), name


def test_zero_b_and_adapters_off_give_the_base_model_exactly(results):
    r = results["forward"]["base_model"]
    for name in ("log_probs", "entropy"):
        assert torch.equal(r["zero_b"][name], r["base"][name])
        assert torch.equal(r["disabled"][name], r["base"][name])
        assert not close(r["adapted"][name], r["base"][name], 1e-3)  # the control: the adapter does change it


def test_adapter_gradients_are_the_same_under_every_layout(results):
    """The TP communication of the adapter path (rank-wide h all-gathered / reduced, A or B of the
    sequence-parallel layers all-reduced over TP after the backward) gives TP1's gradients."""
    grads = results["grads"]
    for layout in ("tp2", "tp2_sp", "pp2"):
        assert sorted(grads[layout]) == sorted(grads["tp1"])
        for name, grad in grads[layout].items():  # fp32 noise of TP is ~2e-6 relative; a missing reduction is O(1)
            reference = grads["tp1"][name]
            assert (grad - reference).norm() <= 1e-5 * reference.norm(), (layout, name)
    assert all(g.abs().max() > 1e-4 for g in grads["tp1"].values())  # every adapter tensor gets a gradient


def test_training_moves_only_the_adapters_and_tp2_sp_trains_as_tp1(work, results):
    tp1, tp2 = results["train/tp1"], results["train/tp2_sp"]
    for name in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy"):
        assert abs(tp1["metrics"][0][name] - tp2["metrics"][0][name]) <= 1e-5, name
        # step 2 starts from adapters that differ by the fp32 noise of one Adam step (~5e-6, amplified where
        # |g| is near eps); the gradient norm is steep in them (it moved 1.8 -> 2.6 in one step of 1e-2)
        assert abs(tp1["metrics"][1][name] - tp2["metrics"][1][name]) <= 1e-4 * max(1.0, abs(tp1["metrics"][1][name])), name
    for name, tensor in tp2["peft"].items():
        assert close(tensor, tp1["peft"][name], 2e-5), name
        assert not torch.equal(tensor, results["forward"]["llama/kaiming_b/tp1"]["peft"][name])  # it trained
    assert close(tp2["log_probs"], tp1["log_probs"], 1e-4)
    expected = peft_merge(original(work, "llama"), tp2["peft"], SCALE)
    for name, tensor in tp2["merged"].items():
        assert close(tensor, expected[name], 1e-6), name
    for record in (tp1, tp2):
        assert record["frozen_with_grads"] == 0
    # the optimizer holds the adapter tensors and nothing else: 2 layers x 4 linears x (A, B)
    rank0 = tp1["optimizer"][0]
    assert len(rank0["adapters"]) == 16 and all(n.endswith((".lora_A", ".lora_B")) for n in rank0["adapters"])
    # TP1 x DP2: the distributed optimizer splits the adapters' Adam state over the two ranks
    assert sorted({n for share in tp1["optimizer"] for n in share["held"]}) == rank0["adapters"]
    assert sum(share["moment_elements"] for share in tp1["optimizer"]) == rank0["adapter_elements"] == 13312
    # TP2 (DP1): each rank's optimizer holds all of its own adapter shards, B of the column-parallel linears
    # and A of the row-parallel ones split, so each rank holds fewer elements than TP1's whole adapters
    for share in tp2["optimizer"]:
        assert share["held"] == share["adapters"] and share["moment_elements"] == share["adapter_elements"] < 13312


def test_full_recompute_trains_the_same_adapters(results):
    plain, recompute = results["train/tp2_sp"], results["train/tp2_sp_recompute"]
    for step in (0, 1):
        assert plain["metrics"][step]["actor/grad_norm"] == pytest.approx(recompute["metrics"][step]["actor/grad_norm"], abs=1e-6)
    for name, tensor in plain["peft"].items():
        assert close(tensor, recompute["peft"][name], 1e-6), name


def test_a_lora_checkpoint_holds_only_adapters_and_resumes_exactly_under_another_layout(results):
    ckpt = results["checkpoint"]
    model_keys = [k for k in ckpt["keys"] if any(s in k for s in ("decoder.", "embedding.", "output_layer."))]
    assert model_keys and all(".lora_A" in k or ".lora_B" in k for k in model_keys), model_keys[:5]
    adapters = {k for k in model_keys if not k.startswith("optimizer")}
    # megatron stacks the layers of a tensor into one key: the 4 linears' A and B
    assert adapters == {f"decoder.layers.{m}.{t}" for m in ("self_attention.linear_qkv", "self_attention.linear_proj",
                                                            "mlp.linear_fc1", "mlp.linear_fc2") for t in ("lora_A", "lora_B")}
    for name, tensor in ckpt["saved_peft"].items():  # loaded under PP2 bit for bit
        assert torch.equal(ckpt["pp2_loaded_peft"][name], tensor), name
    continued, resumed = ckpt["continued"], ckpt["pp2_resumed"]
    for name in ("actor/pg_loss", "actor/grad_norm", "actor/lr"):  # the next step: TP2+SP and PP2 agree to fp32 noise
        assert abs(continued[name] - resumed[name]) <= 1e-5 * max(1.0, abs(continued[name])), name
    for name, tensor in ckpt["continued_peft"].items():
        assert close(tensor, ckpt["pp2_resumed_peft"][name], 1e-6), name
    assert "holds only the trained tensors of a LoRA run" in ckpt["full_model_load_error"]


def test_conversion_merges_a_lora_checkpoint_or_writes_its_peft_adapter(work, results, tmp_path):
    """``megatron-to-hf`` on the LoRA checkpoint (adapters only, written at TP2+SP), converted on one
    process: the merged model is W + alpha/r * B A with the base from ``--hf-config``'s weights, and
    ``--adapter-only`` writes the checkpoint's adapter in PEFT format."""
    import json

    from tests.conversion.conftest import assert_ok, run_cli

    saved = results["checkpoint"]["saved_peft"]
    checkpoint, base = work / "lora_checkpoints", work / _worker.LLAMA
    assert_ok(run_cli(["megatron-to-hf", "--checkpoint", checkpoint, "--hf-config", base, "--out", tmp_path / "merged"]))
    merged = {}
    for shard in sorted((tmp_path / "merged").glob("*.safetensors")):
        merged.update(load_file(str(shard)))
    expected = peft_merge(original(work, _worker.LLAMA), saved, SCALE)
    assert sorted(merged) == sorted(expected)
    for name, tensor in merged.items():
        assert close(tensor, expected[name], 1e-6), name
    assert any(not torch.equal(merged[n], original(work, _worker.LLAMA)[n]) for n in merged)  # the adapters count

    assert_ok(run_cli(["megatron-to-hf", "--checkpoint", checkpoint, "--hf-config", base, "--out", tmp_path / "adapter",
                       "--adapter-only"]))
    adapter = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert sorted(adapter) == sorted(saved)
    for name, tensor in adapter.items():
        assert torch.equal(tensor, saved[name]), name
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (_worker.KAIMING_B.rank, _worker.KAIMING_B.alpha)


def test_canonical_lora_gives_each_projection_its_own_adapter_under_every_layout(results):
    """lora.type=canonical_lora: q, k and v (gate and up) each have their own A; the fused linear holds them
    as one rank-3r (2r) adapter with a block-diagonal B, so the export is per projection as PEFT's."""
    canonical = results["forward"]["llama/canonical/tp1"]["peft"]
    shared = results["forward"]["llama/kaiming_b/tp1"]["peft"]
    assert sorted(canonical) == sorted(shared)  # the same PEFT tensors, of the same shapes
    a = {p: canonical[f"base_model.model.model.layers.0.{p}.lora_A.weight"]
         for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
    assert all(t.shape[0] == 4 for t in a.values()), {k: t.shape for k, t in a.items()}  # rank r each
    assert not torch.equal(a["self_attn.q_proj"], a["self_attn.k_proj"])  # each its own A
    assert not torch.equal(a["mlp.gate_proj"], a["mlp.up_proj"])
    assert torch.equal(shared["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"],
                       shared["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"])  # lora: one A


def test_canonical_lora_trains_at_tp2_sp_as_at_tp1_and_stays_per_projection(work, results):
    tp1, tp2 = results["train/canonical_tp1"], results["train/canonical_tp2_sp"]
    for name in ("actor/pg_loss", "actor/grad_norm"):
        assert abs(tp1["metrics"][0][name] - tp2["metrics"][0][name]) <= 1e-5, name
    start = results["forward"]["llama/canonical/tp1"]["peft"]
    for name, tensor in tp2["peft"].items():
        assert close(tensor, tp1["peft"][name], 2e-5), name
        assert not torch.equal(tensor, start[name])  # it trained
    expected = peft_merge(original(work, "llama"), tp2["peft"], SCALE)  # still exactly per-projection adapters
    for name, tensor in tp2["merged"].items():
        assert close(tensor, expected[name], 1e-6), name


def test_any_peft_adapter_starts_a_run_with_hf_peft_log_probs_and_round_trips(work, results):
    """An adapter written by PEFT (q/k/v/o/gate/up/down, each its own random A and B) loads with
    canonical_lora at TP1 and TP2+SP: the engine's log-probs are HF+PEFT's, its export is the file's
    tensors exactly, and after a training step the exported adapter, loaded by PEFT, gives the engine's."""
    import json

    from safetensors.torch import load_file as load

    from megarl.models.lora.peft import ADAPTER_CONFIG, peft_config

    original_adapter = load(str(work / "peft_any" / "adapter_model.safetensors"))
    reference = peft_model_log_probs(work, work / "peft_any")
    for layout in ("tp1", "tp2_sp"):
        record = results[f"peft_start/{layout}"]
        assert close(record["log_probs"], reference), (layout, (record["log_probs"] - reference).abs().max())
        assert sorted(record["peft"]) == sorted(original_adapter)
        for name, tensor in original_adapter.items():
            assert torch.equal(record["peft"][name], tensor), (layout, name)
    trained = work / "peft_trained"
    trained.mkdir()
    record = results["peft_start/tp2_sp"]
    save_file(record["trained_peft"], str(trained / "adapter_model.safetensors"))
    (trained / ADAPTER_CONFIG).write_text(json.dumps(peft_config(_worker.PEFT_ANY, work / "llama", work / "llama")))
    assert close(peft_model_log_probs(work, trained, "second"), record["trained_log_probs"])
