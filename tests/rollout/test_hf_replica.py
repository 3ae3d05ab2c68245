"""The hf rollout replica in this process (no Ray): decoding, seeds, batching, stops, log-probs, weights.

``HFReplica`` is a plain class that Ray wraps as an actor; here its coroutines run in one event
loop, so concurrent requests share its continuous batch as they do in the actor. The reference is
the same checkpoint in transformers itself: its greedy ``generate`` and its teacher-forced forward.
"""
from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from tests.rollout.test_fleet import hf_logprobs, max_diff, processed_logprobs

MAX_TOKENS = 12
TOLERANCE = 1e-5  # fp32 batched decode vs an fp32 forward of the whole sequence


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megarl.devtools.tiny_model import make_tiny_model

    return make_tiny_model("llama", "tiny", out_dir=tmp_path_factory.mktemp("hf_replica") / "llama", seed=0)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(t)["input_ids"] for t in ["What is 12 + 7?", "Name a prime number.", "Count to three:", "Hello"]]


def spec(model_dir, **changes):
    from megarl.rollout.hf.registration import HFReplicaSpec

    values = dict(model_path=str(model_dir), tokenizer_path=None, dtype="auto", max_model_len=36, max_num_seqs=16,
                  seed=7, cpu_threads=1)
    values.update(changes)
    return HFReplicaSpec(**values)


@pytest.fixture(scope="module")
def run(model_dir):
    """``run(coroutine_fn)``: await ``coroutine_fn(replica)`` on one replica and one event loop for the module."""
    from megarl.rollout.hf.replica import HFReplica

    loop = asyncio.new_event_loop()
    replica = HFReplica(0, spec(model_dir))
    yield lambda fn: loop.run_until_complete(fn(replica))
    loop.run_until_complete(replica.close())
    loop.close()


async def decoded(replica, tokens: int) -> None:
    """Wait (event-loop turns, no clock) until a running sequence has ``tokens`` tokens."""
    while not any(len(s.token_ids) >= tokens for s in replica.scheduler.running):
        await asyncio.sleep(0)


def kwargs(**changes):
    values = dict(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=MAX_TOKENS, stop=None, ignore_eos=False,
                  logprobs=0)
    values.update(changes)
    return values


def test_greedy_is_transformers_generate_and_its_log_probs_are_the_forwards(run, prompts, hf_model):
    samples = run(lambda r: r.generate([(i, p, 0) for i, p in enumerate(prompts)], kwargs(temperature=0.0)))
    assert [(s.prompt_index, s.sample_index, s.replica) for s in samples] == [(i, 0, 0) for i in range(4)]
    for sample in samples:
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([sample.prompt_ids]), do_sample=False,
                                         max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS)
        assert sample.response_ids == expected[0, len(sample.prompt_ids):].tolist()
        assert sample.finish_reason == "length" and len(sample.logprobs) == MAX_TOKENS
        assert max_diff(sample.logprobs, hf_logprobs(hf_model, sample.prompt_ids, sample.response_ids)) < TOLERANCE
    scored = run(lambda r: r.score([s.prompt_ids + s.response_ids for s in samples], [len(s.prompt_ids) for s in samples]))
    assert all(max_diff(row, s.logprobs) < TOLERANCE for row, s in zip(scored, samples))


def test_a_requests_tokens_depend_on_its_seed_alone_not_on_the_batch(run, prompts):
    """The same request alone, among others that start with it, and joining a batch already running
    (continuous batching: it is admitted between two decode steps of the others)."""
    request = (0, prompts[0], 1234)
    alone = run(lambda r: r.generate([request], kwargs(n=3, ignore_eos=True)))

    async def joining(replica):
        others = asyncio.ensure_future(replica.generate([(i, prompts[i], 50 + i) for i in (1, 2, 3)],
                                                        kwargs(n=4, ignore_eos=True, max_tokens=20)))
        await decoded(replica, 2)  # the others have decoded 2 of their 20 tokens
        mine = await replica.generate([request], kwargs(n=3, ignore_eos=True))
        assert not others.done()  # it ran beside them
        return mine, await others

    crowded = run(lambda r: r.generate([(1, prompts[1], 9), request, (2, prompts[3], 99)], kwargs(n=3, ignore_eos=True)))
    joined, others = run(joining)
    mine = [s for s in crowded if s.prompt_index == 0]
    assert [s.response_ids for s in mine] == [s.response_ids for s in alone] == [s.response_ids for s in joined]
    for a, b in zip(alone, joined):
        assert max_diff(a.logprobs, b.logprobs) < TOLERANCE
    assert len({tuple(s.response_ids) for s in alone}) == 3  # sample k is seeded request_seed + k
    again = run(lambda r: r.generate([request], kwargs(n=3, ignore_eos=True)))
    assert [s.response_ids for s in again] == [s.response_ids for s in alone]
    other_seed = run(lambda r: r.generate([(0, prompts[0], 4321)], kwargs(n=3, ignore_eos=True)))
    assert [s.response_ids for s in other_seed] != [s.response_ids for s in alone]
    assert len(others) == 12 and all(len(s.response_ids) == 20 for s in others)


@pytest.mark.parametrize("sampling", [dict(temperature=0.7), dict(temperature=1.0), dict(temperature=0.7, top_p=0.8),
                                      dict(temperature=1.3, top_k=5), dict(temperature=0.9, top_k=20, top_p=0.5)],
                         ids=["T0.7", "T1", "T0.7-top_p0.8", "T1.3-top_k5", "T0.9-top_k20-top_p0.5"])
def test_log_probs_are_those_of_the_distribution_sampled_from(run, prompts, hf_model, sampling):
    """processed_logprobs: vLLM's formula (tests/rollout/test_fleet.py's reference), every sampled
    token inside the kept set; with top-k/top-p the truncation shows as -log(mass kept) >= 0."""
    samples = run(lambda r: r.generate([(i, p, 11 + i) for i, p in enumerate(prompts)], kwargs(n=2, **sampling)))
    temperature, top_p, top_k = sampling["temperature"], sampling.get("top_p", 1.0), sampling.get("top_k", -1)
    gaps = []
    for sample in samples:
        with torch.no_grad():
            logits = hf_model(torch.tensor([sample.prompt_ids + sample.response_ids])).logits[0]
        rows = logits[len(sample.prompt_ids) - 1:len(sample.prompt_ids) - 1 + len(sample.response_ids)]
        tokens = torch.tensor(sample.response_ids)
        expected = processed_logprobs(rows, temperature, top_p, top_k).gather(-1, tokens[:, None])[:, 0]
        assert torch.isfinite(expected).all()
        assert max_diff(sample.logprobs, expected.tolist()) < TOLERANCE
        gaps += (torch.tensor(sample.logprobs) - torch.log_softmax(rows / temperature, -1).gather(-1, tokens[:, None])[:, 0]).tolist()
    if top_p == 1.0 and top_k == -1:
        assert max(abs(g) for g in gaps) < TOLERANCE
    else:
        assert min(gaps) > -TOLERANCE and max(gaps) > 1e-3


def test_raw_logprobs_are_before_temperature(model_dir, prompts, hf_model):
    from megarl.rollout.hf.replica import HFReplica

    async def go():
        replica = HFReplica(1, spec(model_dir, logprobs_mode="raw_logprobs"))
        try:
            return await replica.generate([(0, prompts[0], 3)], kwargs(temperature=0.5, top_k=5))
        finally:
            await replica.close()

    [sample] = asyncio.run(go())
    assert max_diff(sample.logprobs, hf_logprobs(hf_model, sample.prompt_ids, sample.response_ids)) < TOLERANCE


def test_stop_strings_stop_token_ids_and_length_limits(run, prompts, tokenizer):
    greedy = run(lambda r: r.generate([(2, prompts[2], 0)], kwargs(temperature=0.0, ignore_eos=True)))[0]
    text = greedy.response_text
    assert text == tokenizer.decode(greedy.response_ids, skip_special_tokens=True)
    stop = next(piece for piece in (tokenizer.decode([t]).strip() for t in greedy.response_ids[1:])
                if piece and piece.isprintable() and "\ufffd" not in piece and text.find(piece) > 0)
    cut = run(lambda r: r.generate([(2, prompts[2], 0)], kwargs(temperature=0.0, ignore_eos=True, stop=[stop])))[0]
    assert cut.finish_reason == "stop" and cut.stop_string == stop and cut.response_text == text[:text.find(stop)]
    assert cut.response_ids == greedy.response_ids[:len(cut.response_ids)]
    assert stop in tokenizer.decode(cut.response_ids) and stop not in tokenizer.decode(cut.response_ids[:-1])

    token = greedy.response_ids[4]
    by_id = run(lambda r: r.generate([(2, prompts[2], 0)], kwargs(temperature=0.0, stop_token_ids=[token])))[0]
    first = greedy.response_ids.index(token)
    assert by_id.finish_reason == "stop" and by_id.stop_string is None
    assert by_id.response_ids == greedy.response_ids[:first + 1]  # the stop token is kept, its text is not
    assert by_id.response_text == tokenizer.decode(greedy.response_ids[:first], skip_special_tokens=True)

    long_prompt = prompts[0] * 3  # 30 tokens: max_model_len=36 leaves room for 6
    capped = run(lambda r: r.generate([(0, long_prompt, 0)], kwargs(ignore_eos=True)))[0]
    assert capped.finish_reason == "length" and len(long_prompt) + len(capped.response_ids) == 36
    short = run(lambda r: r.generate([(0, prompts[0], 0)], kwargs(max_tokens=3, ignore_eos=True, n=2)))
    assert all(len(s.response_ids) == 3 and s.finish_reason == "length" for s in short)


def test_eos_stops_unless_ignored_and_generation_config_eos_ids_stop_with_their_id(model_dir, prompts, tmp_path):
    """A copy of the checkpoint whose tokenizer's EOS is a token greedy decoding reaches, and one whose
    generation config lists it as an extra EOS id (vLLM: a stop token, reported as the stop reason)."""
    from transformers import AutoTokenizer

    from megarl.rollout.hf.replica import HFReplica

    async def greedy(directory, **changes):
        replica = HFReplica(2, spec(directory))
        try:
            return (await replica.generate([(0, prompts[1], 0)], kwargs(temperature=0.0, **changes)))[0]
        finally:
            await replica.close()

    plain = asyncio.run(greedy(model_dir, ignore_eos=True))
    token = plain.response_ids[3]
    as_eos, as_extra = tmp_path / "eos", tmp_path / "extra"
    for copy in (as_eos, as_extra):
        shutil.copytree(model_dir, copy)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = json.loads((as_eos / "tokenizer_config.json").read_text())
    config["eos_token"] = tokenizer.convert_ids_to_tokens(token)
    (as_eos / "tokenizer_config.json").write_text(json.dumps(config))
    generation = json.loads((as_extra / "generation_config.json").read_text())
    generation["eos_token_id"] = [generation["eos_token_id"], token]
    (as_extra / "generation_config.json").write_text(json.dumps(generation))

    first = plain.response_ids.index(token)
    stopped = asyncio.run(greedy(as_eos))
    assert stopped.finish_reason == "stop" and stopped.response_ids == plain.response_ids[:first + 1]
    assert asyncio.run(greedy(as_eos, ignore_eos=True)).response_ids == plain.response_ids
    extra = asyncio.run(greedy(as_extra))
    assert extra.finish_reason == "stop" and extra.response_ids == plain.response_ids[:first + 1]
    assert asyncio.run(greedy(as_extra, ignore_eos=True)).response_ids == plain.response_ids


def test_bad_settings_are_refused_with_the_key(run, prompts, model_dir):
    with pytest.raises(ValueError, match="sampling keys \\['min_p'\\] are not supported by the hf rollout backend"):
        run(lambda r: r.generate([(0, prompts[0], 0)], kwargs(min_p=0.1)))
    with pytest.raises(ValueError, match="top_p=0.0 must be in \\(0, 1\\]"):
        run(lambda r: r.generate([(0, prompts[0], 0)], kwargs(top_p=0.0)))
    with pytest.raises(ValueError, match="generate_tokens returns one completion; got n=2"):
        run(lambda r: r.generate_tokens(prompts[0], kwargs(n=2), 0))
    with pytest.raises(RuntimeError, match="merged weights only: adapter-only LoRA"):
        run(lambda r: r.load_adapter({}, 1))
    with pytest.raises(RuntimeError, match="no sleep mode"):
        run(lambda r: r.sleep(1))
    from megarl.rollout.hf.replica import HFReplica

    with pytest.raises(ValueError, match="max_model_len=4096 .* exceeds the model's max_position_embeddings=2048"):
        HFReplica(3, spec(model_dir, max_model_len=4096))


def test_a_group_request_samples_what_its_single_requests_and_the_batch_do(run, prompts, hf_model):
    """generate_group(seed): sample k is generate_tokens(seed + k) and the batch generate's sample k
    of a request seeded ``seed`` (tokens, log-probs, text, finish); the same seed, the same group."""
    group = run(lambda r: r.generate_group(prompts[1], kwargs(n=3), 77))

    async def singles(replica):
        return await asyncio.gather(*[replica.generate_tokens(prompts[1], kwargs(), 77 + k) for k in range(3)])

    alone = run(singles)
    batch = run(lambda r: r.generate([(1, prompts[1], 77)], kwargs(n=3)))
    assert [g.token_ids for g in group] == [g.token_ids for g in alone] == [s.response_ids for s in batch]
    assert [(g.text, g.finish_reason, g.stop_string) for g in group] == \
        [(g.text, g.finish_reason, g.stop_string) for g in alone] == \
        [(s.response_text, s.finish_reason, s.stop_string) for s in batch]
    assert all(g.versions == [0] * len(g.token_ids) for g in group)
    for g, single, sample in zip(group, alone, batch):
        assert max_diff(g.logprobs, single.logprobs) < TOLERANCE and max_diff(g.logprobs, sample.logprobs) < TOLERANCE
        assert max_diff(g.logprobs, hf_logprobs(hf_model, prompts[1], g.token_ids)) < TOLERANCE
    assert len({tuple(g.token_ids) for g in group}) == 3  # the seeds took effect
    assert [g.token_ids for g in run(lambda r: r.generate_group(prompts[1], kwargs(n=3), 77))] == \
        [g.token_ids for g in group]
    assert [g.token_ids for g in run(lambda r: r.generate_group(prompts[1], kwargs(n=3), 78))] != \
        [g.token_ids for g in group]


def test_an_aborted_group_continues_each_sample_alone_on_its_own_seed(run, prompts, hf_model):
    """pause("abort") mid-way: every sample keeps its tokens and continues as a request of its own,
    seeded as sample k's own request would be (``segment_seed(seed + k, 1)``)."""
    from megarl.rollout.gate import segment_seed

    settings = kwargs(n=3, ignore_eos=True)
    whole = run(lambda r: r.generate_group(prompts[0], settings, 5))

    async def interrupted(replica):
        task = asyncio.ensure_future(replica.generate_group(prompts[0], settings, 5))
        await decoded(replica, 3)
        await replica.pause("abort")
        assert replica.gate.running == 0 and not task.done()  # aborted, waiting at the closed gate
        await replica.resume()
        return await task

    group = run(interrupted)
    for g in group:
        assert len(g.token_ids) == len(g.logprobs) == MAX_TOKENS and g.versions == [0] * MAX_TOKENS
        assert g.finish_reason == "length"
        assert max_diff(g.logprobs, hf_logprobs(hf_model, prompts[0], g.token_ids)) < TOLERANCE
    agree = min(next((i for i, (a, b) in enumerate(zip(w.token_ids, g.token_ids)) if a != b), MAX_TOKENS)
                for w, g in zip(whole, group))
    assert 3 <= agree < MAX_TOKENS  # the same tokens up to the abort, then the continuation's own seed

    async def continued_alone(replica, cut: int) -> bool:
        rest = await asyncio.gather(*[replica.generate_tokens(prompts[0] + g.token_ids[:cut],
                                                              kwargs(ignore_eos=True, max_tokens=MAX_TOKENS - cut),
                                                              segment_seed(5 + k, 1)) for k, g in enumerate(group)])
        return all(r.token_ids == g.token_ids[cut:] for r, g in zip(rest, group))

    # the abort cut every sample at the same step; one cut at or before the first difference explains all three
    assert any(run(lambda r, cut=cut: continued_alone(r, cut)) for cut in range(3, agree + 1))


def test_pause_with_abort_resumes_the_request_and_a_failed_sync_stops_generation(run, prompts, hf_model):
    """generate_tokens survives an abort (it continues from its tokens, as after a sync); a sync that
    fails (here: receive before connect) leaves the weights stale, and the replica refuses to serve."""
    async def interrupted(replica):
        task = asyncio.ensure_future(replica.generate_tokens(prompts[0], kwargs(ignore_eos=True), 5))
        await decoded(replica, 3)
        await replica.pause("abort")
        assert replica.gate.running == 0 and not task.done()  # aborted, waiting at the closed gate
        await replica.resume()
        return await task

    whole = run(lambda r: r.generate_tokens(prompts[0], kwargs(ignore_eos=True), 5))
    generation = run(interrupted)
    assert len(generation.token_ids) == MAX_TOKENS and generation.versions == [0] * MAX_TOKENS
    cut = next(i for i, (a, b) in enumerate(zip(whole.token_ids, generation.token_ids)) if a != b)
    assert cut >= 3  # the same tokens up to the abort, then the continuation's own seed
    assert max_diff(generation.logprobs, hf_logprobs(hf_model, prompts[0], generation.token_ids)) < TOLERANCE

    with pytest.raises(RuntimeError, match="megarl_sync_receive before megarl_sync_connect"):
        run(lambda r: r.sync_receive(1))
    with pytest.raises(RuntimeError, match="replica 0 refuses to generate: weight sync to version 1 failed"):
        run(lambda r: r.generate([(0, prompts[0], 0)], kwargs()))
    with pytest.raises(RuntimeError, match="refuses to generate"):
        run(lambda r: r.weights_version())


@pytest.mark.parametrize("family,tied", [("qwen3_moe", False), ("mixtral", False), ("deepseek_v3", False),
                                         ("llama", True), ("gpt_oss", False)])
def test_checkpoint_tensors_fill_the_model_tensors_exactly(tmp_path, family, tied):
    """transformers 5 fuses MoE experts (and renames Mixtral's): each checkpoint tensor, written through
    its target, restores the model that transformers loaded from the same files; a plan that lacks a
    tensor, or sends one the model has not, is refused at connect. gpt-oss's checkpoint packs its experts:
    the sync sends the bridge's per-expert parts, each read from its packed tensor here."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megarl.devtools.tiny_model import make_tiny_model
    from megarl.models import hf_tensor_shapes, model_dims
    from megarl.models.families import family_for
    from megarl.models.dims import load_hf_config
    from megarl.models.packed import packed_parts
    from megarl.rollout.hf.weights import SyncReceiver
    from megarl.weight_sync.errors import SyncError

    directory = make_tiny_model(family, "tiny", out_dir=tmp_path / family, seed=1, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    loaded = {name: t.clone() for name, t in model.state_dict().items()}
    receiver = SyncReceiver(model, torch.device("cpu"))
    needed = hf_tensor_shapes(str(directory))
    receiver._check_plan(needed, 0)  # what the sync sends is exactly what the model needs
    checkpoint = {}
    for path in sorted(directory.glob("*.safetensors")):
        checkpoint.update(load_file(path))
    parts = packed_parts(family_for(load_hf_config(str(directory))), model_dims(str(directory)))
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.zero_()
        for name in needed:
            packed, row, unpack = parts.get(name, (None, 0, None))
            receiver.targets[name].write(checkpoint[name] if packed is None else unpack(checkpoint[packed.name][row]))
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in loaded.items())
    dropped = sorted(needed)[len(needed) // 2]
    with pytest.raises(SyncError, match="nothing would update \\['.*'\\]"):
        receiver._check_plan({n: s for n, s in needed.items() if n != dropped}, 0)
    with pytest.raises(SyncError, match="the model has no tensor for \\['model.extra.weight'\\]"):
        receiver._check_plan({**needed, "model.extra.weight": (1,)}, 0)


@pytest.mark.parametrize("family", ["qwen3_next", "gpt_oss"])
def test_recurrent_and_window_caches_run_row_by_row_with_transformers_numbers(family, tmp_path):
    """Linear attention (Qwen3-Next's DeltaNet state) and sliding windows (gpt-oss) cannot share a left-padded
    cache: such a model runs row by row. Greedy equals transformers' generate and the log-probs its forward,
    with a prompt's n samples started from copies of one prefill and a short request leaving the batch early
    (the other rows keep their own caches)."""
    from transformers import AutoModelForCausalLM

    from megarl.devtools.tiny_model import make_tiny_model
    from megarl.rollout.hf.replica import HFReplica

    model_dir = make_tiny_model(family, "tiny", tmp_path / family, seed=0)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [[5, 17, 42, 9, 7, 7, 3], [250, 11], [31, 64, 128, 5, 6, 7, 100, 12, 9]]  # windows shorter than them
    replica = HFReplica(0, spec(model_dir))
    assert replica.engine.per_row

    async def both(r):
        return await asyncio.gather(r.generate([(i, p, 0) for i, p in enumerate(prompts)], kwargs(n=2, temperature=0.0)),
                                    r.generate([(9, prompts[1], 0)], kwargs(temperature=0.0, max_tokens=3)))

    loop = asyncio.new_event_loop()
    try:
        samples, short = loop.run_until_complete(both(replica))
    finally:
        loop.run_until_complete(replica.close())
        loop.close()
    assert len(samples) == 6 and len(short[0].response_ids) == 3
    for sample in samples + short:
        tokens = len(sample.response_ids)
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([sample.prompt_ids]), do_sample=False, max_new_tokens=tokens,
                                         min_new_tokens=tokens)
        assert sample.response_ids == expected[0, len(sample.prompt_ids):].tolist(), (family, sample.prompt_index)
        assert max_diff(sample.logprobs, hf_logprobs(hf_model, sample.prompt_ids, sample.response_ids)) < TOLERANCE
