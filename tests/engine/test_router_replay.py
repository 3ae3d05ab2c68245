"""MoE router replay in the engine (``megarl.engine.router_replay``), against Hugging Face.

The reference is the tiny Qwen3-MoE in transformers with its routers patched: they report their own
top-k choice, or take a given one (the gate weights are still the router's softmax over the chosen
experts, renormalised, as Qwen3-MoE does). On 2 ranks (TP=2 with sequence parallelism and full
activation recompute, PP=2 on padded rows, EP=2 with data parallelism) the engine must

* record exactly the experts HF's routers choose, for every real token of every layer (-1 at padding);
* replaying a table that sends every token to the two experts its router would NOT choose, give
  HF's log-probs under that forced routing (far from the live ones), in the log-prob pass;
* train under it: the update's loss, gradient norm and weights equal an HF step under the same routing
  (the recompute in the backward pass replays the same table).
"""
from contextlib import contextmanager

import pytest
import torch

import _engine_data as _data
import _engine_hf as _hf_reference
from _engine_launch import run_worker
from megarl.engine.router_replay import check_table

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

TOLERANCE = 1e-5
WORKER = __import__("pathlib").Path(__file__).with_name("_replay_worker.py")
LAYOUTS = ("tp2_sp_recompute", "pp2_padded", "ep2")


@contextmanager
def hf_routing(model, forced: torch.Tensor | None, seen: dict):
    """Patch every Qwen3-MoE router of ``model``: record its choice into ``seen[layer]`` ([B*T, k]) and,
    with ``forced [B, T, L, k]``, route by it (-1 rows: the router's own choice)."""
    import torch.nn.functional as F

    routers = [layer.mlp.gate for layer in model.model.layers]
    originals = [router.forward for router in routers]

    def patched(router, layer):
        def forward(hidden_states):
            hidden = hidden_states.reshape(-1, router.hidden_dim)
            logits = F.linear(hidden, router.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            natural = torch.topk(probs, router.top_k, dim=-1).indices
            seen[layer] = natural
            indices = natural
            if forced is not None:
                target = forced[:, :, layer].reshape(-1, router.top_k).long()
                indices = torch.where(target[:, :1] >= 0, target, natural)
            values = probs.gather(1, indices)
            values = values / values.sum(dim=-1, keepdim=True)
            return logits, values.to(logits.dtype), indices
        return forward

    for layer, router in enumerate(routers):
        router.forward = patched(router, layer)
    try:
        yield
    finally:
        for router, original in zip(routers, originals):
            router.forward = original


def hf_natural_table(model_dir, batch) -> torch.Tensor:
    model = _hf_reference.load_causal_lm(model_dir).eval()
    seen = {}
    with hf_routing(model, None, seen), torch.no_grad():
        _hf_reference.response_outputs(model, batch)
    B, T = batch.input_ids.shape
    table = torch.stack([seen[layer].view(B, T, -1) for layer in sorted(seen)], dim=2)
    return torch.where(batch.attention_mask.bool()[..., None, None], table, torch.full_like(table, -1)).to(torch.int16)


def complement(table: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Per token and layer, the experts NOT in ``table`` (top-2 of 4: the other two); -1 stays -1."""
    chosen = torch.zeros(*table.shape[:-1], num_experts, dtype=torch.bool)
    chosen.scatter_(-1, table.clamp(min=0).long(), True)
    others = torch.argsort(chosen.int(), dim=-1, stable=True)[..., : table.shape[-1]]  # the unchosen come first
    return torch.where(table[..., :1] >= 0, others, -1).to(torch.int16)


@pytest.fixture(scope="module")
def reference(engine_work, data):
    batch = data["batches"][_data.MOE]
    natural = hf_natural_table(engine_work / _data.MOE, batch)
    forced = complement(natural, num_experts=4)
    torch.save(forced, engine_work / "forced.pt")
    model = _hf_reference.load_causal_lm(engine_work / _data.MOE).eval()
    with hf_routing(model, forced, {}), torch.no_grad():
        forced_log_probs, _ = _hf_reference.log_probs_and_entropy(_hf_reference.response_outputs(model, batch), batch)
    live_log_probs, _ = _hf_reference.hf_log_probs(engine_work / _data.MOE, batch)
    return {"natural": natural, "forced": forced, "forced_log_probs": forced_log_probs, "live_log_probs": live_log_probs,
            "batch": batch}


@pytest.fixture(scope="module")
def replayed(engine_work, reference):
    return run_worker(engine_work, "replay", processes=2, timeout=380, worker=WORKER)


@pytest.fixture(scope="module")
def hf_forced_step(engine_work, reference):
    """HF's training step under the forced routing (the patch stays on through backward)."""
    import _engine_hf

    original, patches = _engine_hf.load_causal_lm, []

    def load_forced(model_dir):
        model = original(model_dir)
        patches.append(hf_routing(model, reference["forced"], {}))
        patches[-1].__enter__()  # held in ``patches`` until the step is done (a dropped generator would undo it)
        return model

    _engine_hf.load_causal_lm = load_forced
    try:
        step = _engine_hf.hf_training_steps(engine_work / _data.MOE, [reference["batch"]], _data.LOSS, _data.OPTIM)
        return {**step, "real_tokens": int(reference["batch"].attention_mask.sum())}
    finally:
        _engine_hf.load_causal_lm = original
        for patch in patches:
            patch.__exit__(None, None, None)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_log_prob_pass_records_the_experts_hugging_face_routes_to(replayed, reference, layout):
    recorded = replayed[layout]["recorded"]
    assert recorded.dtype == torch.int16 and recorded.shape == reference["natural"].shape
    assert torch.equal(recorded.sort(-1).values, reference["natural"].sort(-1).values)
    assert (replayed[layout]["live_log_probs"] - reference["live_log_probs"]).abs().max() <= TOLERANCE


@pytest.mark.parametrize("layout", LAYOUTS)
def test_replaying_a_table_gives_the_log_probs_of_that_routing(replayed, reference, layout):
    gap = (reference["forced_log_probs"] - reference["live_log_probs"]).abs().max()
    assert gap > 0.01  # the forced routing is far from the live one
    assert (replayed[layout]["replayed_log_probs"] - reference["forced_log_probs"]).abs().max() <= TOLERANCE


def reference_tokens(step) -> int:
    return step["real_tokens"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_update_trains_under_the_replayed_routing(replayed, hf_forced_step, layout):
    result = replayed[layout]
    assert result["metrics"]["actor/pg_loss"] == pytest.approx(hf_forced_step["pg_losses"][0], rel=1e-5, abs=1e-6)
    assert result["metrics"]["actor/grad_norm"] == pytest.approx(hf_forced_step["grad_norms"][0], rel=1e-4)
    # every replayed choice (real token x layer, counted once over the ranks) differs from the live router's
    real_tokens = int(reference_tokens(hf_forced_step)) * 2
    assert result["metrics"]["actor/router_replay_tokens"] == real_tokens
    assert result["metrics"]["actor/router_replay_overridden"] == 1.0
    weights, expected = result["weights"], hf_forced_step["weights"]
    assert max((weights[name] - expected[name]).abs().max().item() for name in weights) <= TOLERANCE


def test_a_table_that_does_not_fit_the_model_is_refused_naming_the_shapes():
    table = torch.zeros(2, 5, 3, 2, dtype=torch.int16)
    with pytest.raises(ValueError, match=r"must be \[batch, tokens, layers, top-k\] = \(2, 5, 4, 2\)"):
        check_table(table, torch.Size([2, 5]), num_layers=4, topk=2, num_experts=4)
    with pytest.raises(ValueError, match="experts outside 0..3"):
        check_table(torch.full((2, 5, 4, 2), 4, dtype=torch.int16), torch.Size([2, 5]), 4, 2, 4)
    with pytest.raises(ValueError, match="old-log-prob pass records it"):
        check_table(None, torch.Size([2, 5]), 4, 2, 4)

