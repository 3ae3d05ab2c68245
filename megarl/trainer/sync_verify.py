"""``verify_sync``: do the rollout engines serve exactly the trainer's weights?

The fleet samples a few responses at the training temperature (without top-k/top-p, so both sides
score one distribution: ``log_softmax(logits / T)``; greedy when the rollout is greedy); the trainer
computes its log-probs of the same tokens at that temperature; the mean absolute difference is
returned. After a correct sync it is at the level of
numerical noise (~1e-6 in fp32 on CPU); stale or partly loaded weights give differences of order
one. (The trainer logs the same comparison on the training samples every step as
``rollout/logprob_diff``, for free.) It drives the fleet and the trainer's workers, so it lives
with the trainer, above the weight-sync layer it checks.
"""
from __future__ import annotations



def verify_sync(fleet, workers, prompt_ids: list[list[int]], max_tokens: int = 8, pad_token_id: int = 0) -> dict[str, float]:
    import ray

    from megarl.agent.trajectory import Trajectory
    from megarl.trainer.megatron_worker import dp_leaders, gather_data_parallel
    from megarl.trainer.rollout_batch import build_step_data

    temperature = float(fleet.config.temperature) if fleet.config.do_sample else 0.0
    sampling = ({"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": -1} if temperature > 0
                else {"do_sample": False})
    samples = fleet.generate(prompt_ids, {**sampling, "max_tokens": max_tokens}, n=1)
    rows = list(range(len(samples)))
    data = build_step_data({}, [Trajectory.from_sample(s) for s in samples], rows, [str(r) for r in rows],
                           pad_token_id)
    leaders = dp_leaders(workers.call("coords"))
    trainer = gather_data_parallel(workers, leaders, "compute_log_prob", ray.put(data.batch), False)[0]
    mask = data.batch.response_mask.bool()
    diff = (trainer - data["rollout_log_probs"]).abs()[mask]
    return {"rollout/logprob_diff": float(diff.mean()), "rollout/logprob_diff_max": float(diff.max()),
            "verify/tokens": float(mask.sum())}
