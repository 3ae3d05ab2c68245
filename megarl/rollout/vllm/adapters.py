"""Where a replica keeps the LoRA adapters it serves (adapter-only weight updates, ``lora.merge=False``).

vLLM loads LoRA adapters from a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``).
A replica receives the actor's adapter as tensors, writes each version into a directory of its
own (on its node: nothing is shared between nodes) and hands vLLM a ``LoRARequest`` whose id is
the version + 1 (ids must be > 0); directories of older versions are removed once a newer one is
served. ``close`` removes them all.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

ADAPTER_NAME = "megarl-actor"


class AdapterStore:
    def __init__(self, replica_index: int):
        self.root = Path(tempfile.mkdtemp(prefix=f"megarl-adapter-{replica_index}-"))
        self.current: Path | None = None

    def write(self, adapter: dict, version: int):
        """(the ``LoRARequest`` for ``adapter`` as version ``version``, bytes written)."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if not isinstance(adapter, dict) or not {"tensors", "config"} <= set(adapter):
            raise TypeError(f"an adapter update is {{'tensors': {{name: tensor}}, 'config': adapter_config}}, got "
                            f"{type(adapter).__name__}")
        folder = self.root / f"v{version}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        tensors = {name: tensor.contiguous() for name, tensor in adapter["tensors"].items()}
        save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        (folder / "adapter_config.json").write_text(json.dumps(adapter["config"]))
        previous, self.current = self.current, folder
        if previous is not None and previous != folder:
            shutil.rmtree(previous, ignore_errors=True)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return LoRARequest(f"{ADAPTER_NAME}-v{version}", int(version) + 1, str(folder)), nbytes

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
