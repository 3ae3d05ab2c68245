"""vLLM's ``AsyncLLM`` with megarl's in-process engine core, against vLLM's own in-process engine; JSON out.

Run by tests/rollout/test_inproc_core.py in a subprocess (vLLM sets process-wide state: its distributed
world, seeds), with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` set by the caller, as ``replica_env`` sets it.

    python inproc_core_script.py OUT.json MODEL_DIR

1. the reference: ``vllm.LLM`` (vLLM's synchronous engine, whose in-process client vLLM ships), 8 prompts,
   seeded sampling at temperature 1, 12 tokens each with their log-probs;
2. megarl's path: ``AsyncLLM`` built as the replica builds it (``engine_core_in_process``), the same 8
   requests at once; one more request aborted after its first tokens while a second one runs on; a
   collective RPC (the worker's pid: the worker runs in this process); the prefix cache reset;
3. an engine whose model step raises: the request in flight raises, and ``AsyncLLM.errored`` is set (what
   the replica's health check reads); then shutdown, twice.
"""
import asyncio
import gc
import json
import os
import sys

MAX_TOKENS = 12
PROMPTS = [[1, 5 + i, 17, 30 + 2 * i, 9] for i in range(8)]


def worker_pid(worker) -> int:
    return os.getpid()


def reference(kwargs: dict) -> list[dict]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**kwargs)
    params = [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0, seed=100 + i)
              for i in range(len(PROMPTS))]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    result = [sample(o.outputs[0]) for o in outputs]
    del llm
    gc.collect()
    return result


def sample(completion) -> dict:
    tokens = list(completion.token_ids)
    return {"tokens": tokens, "logprobs": [step[t].logprob for step, t in zip(completion.logprobs, tokens)]}


async def last(generator):
    output = None
    async for output in generator:
        pass
    return output


async def exercise(engine) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def params(seed: int, max_tokens: int = MAX_TOKENS):
        return SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, seed=seed)

    outputs = await asyncio.gather(*[last(engine.generate(TokensPrompt(prompt_token_ids=p), params(100 + i), f"r{i}"))
                                     for i, p in enumerate(PROMPTS)])
    samples = [sample(o.outputs[0]) for o in outputs]

    # an abort mid-generation, while another request runs on
    long_request = engine.generate(TokensPrompt(prompt_token_ids=PROMPTS[0]), params(1, max_tokens=200), "long")
    other = asyncio.ensure_future(last(engine.generate(TokensPrompt(prompt_token_ids=PROMPTS[1]), params(2), "other")))
    seen = 0
    async for output in long_request:
        seen = len(output.outputs[0].token_ids)
        if seen >= 3:
            await engine.abort("long")
    finished_other = await other
    pids = await engine.collective_rpc(worker_pid)
    reset = await engine.reset_prefix_cache()
    idle = engine.engine_core.engine_core.scheduler.has_requests()
    return {"samples": samples, "aborted_at": seen, "other_tokens": len(finished_other.outputs[0].token_ids),
            "worker_pids": pids, "pid": os.getpid(), "prefix_cache_reset": reset, "requests_left": idle}


async def failing(engine) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def broken(*args, **kwargs):
        raise RuntimeError("a model step failed, on purpose")

    engine.engine_core.engine_core.model_executor.execute_model = broken
    try:
        await last(engine.generate(TokensPrompt(prompt_token_ids=PROMPTS[0]), SamplingParams(max_tokens=4), "doomed"))
    except Exception as exc:  # noqa: BLE001 - what the caller of generate sees
        raised = f"{type(exc).__name__}: {exc}"
    else:
        raised = None
    return {"raised": raised, "errored": engine.errored}


def main() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from megarl.rollout.vllm.engine_config import ReplicaSpec, llm_kwargs
    from megarl.rollout.vllm.inproc_core import InprocAsyncClient, engine_core_in_process

    out_path, model_dir = sys.argv[1], sys.argv[2]
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    spec = ReplicaSpec(model_path=model_dir, tokenizer_path=None, tensor_parallel_size=1, dtype="float32",
                       max_model_len=256, max_num_seqs=16, max_num_batched_tokens=512, enable_chunked_prefill=False,
                       enforce_eager=True, gpu_memory_utilization=0.5, enable_sleep_mode=False, seed=0, cpu_threads=1,
                       cpu_kv_cache_bytes=64 << 20)
    kwargs = llm_kwargs(spec, on_gpu=False)
    result = {"reference": reference({k: v for k, v in kwargs.items() if k != "worker_extension_cls"})}

    def start():
        with engine_core_in_process():
            engine = AsyncLLM.from_vllm_config(AsyncEngineArgs(**kwargs).create_engine_config(), disable_log_stats=True)
        assert isinstance(engine.engine_core, InprocAsyncClient), type(engine.engine_core)
        return engine

    engine = start()
    result.update(asyncio.run(exercise(engine)))
    engine.shutdown()
    engine.shutdown()  # idempotent
    del engine
    gc.collect()
    engine = start()
    result["failure"] = asyncio.run(failing(engine))
    engine.shutdown()
    del engine  # before the interpreter's exit tears down what AsyncLLM.__del__ would use
    gc.collect()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
