"""A plan as text (``megarl plan``) and as JSON (``megarl plan --json``)."""
from __future__ import annotations

import json
from dataclasses import asdict

from megarl.plan.hardware import GB, figures


def _gb(n: float) -> str:
    return f"{n / GB:6.1f} GB"


def _s(seconds: float) -> str:
    return f"{seconds:8.2f} s" if seconds >= 0.1 else f"{seconds * 1e3:6.1f} ms"


def render(plan, title: str = "") -> str:
    inputs, hw, eff, mem, t = plan.inputs, plan.hardware, plan.efficiency, plan.memory, plan.time
    model = inputs.role("actor").model
    lay, placement, rollout = inputs.layout, inputs.placement, inputs.rollout
    moe = model.dims.moe
    lines = [f"megarl plan{': ' + title if title else ''}",
             f"model: {model.dims.architecture}, {model.hf_params / 1e9:.2f}B parameters"
             + (f", {model.active_params / 1e9:.2f}B active ({moe.topk} of {moe.num_experts} experts)" if moe else "")
             + (f", of which {model.vision_params / 1e9:.2f}B the vision tower (whole on each TP rank of the first "
                "stage)" if model.vision_params else ""),
             f"hardware: {hw.name}: {hw.memory_gb:.0f} GB, {hw.bf16_tflops:.0f} TFLOP/s bf16 dense, HBM {hw.hbm_gbps:.0f} "
             f"GB/s, NVLink {hw.nvlink_gbps:.0f} GB/s, network {hw.ib_gbps:.0f} GB/s per GPU and direction",
             f"assumed: MFU {eff.mfu}, decode at {eff.decode_hbm} of HBM bandwidth, prefill at {eff.prefill_mfu} of peak, "
             f"links at {eff.link} of line rate, TP all-reduce {eff.tp_latency_us:g} us ({eff.ib_latency_us:g} us "
             f"across nodes), {eff.cuda_context_gb:g} GB CUDA context per process",
             f"layout: {placement.nnodes} x {placement.per_node} GPUs, {placement.mode}; trainer TP{lay.tp} x PP{lay.pp}"
             + (f" (VPP{lay.vpp})" if lay.vpp > 1 else "") + (f" x EP{lay.ep}" if lay.ep > 1 else "")
             + (f" x ETP{lay.etp}" if lay.etp > 1 else "") + (f" x CP{inputs.cp}" if inputs.cp > 1 else "")
             + f" x DP{inputs.dp}"
             + (" + SP" if lay.sequence_parallel else "") + f" on {inputs.trainer_world} GPUs; rollout "
             f"{rollout.replicas} x TP{rollout.tp}",
             f"batch: {inputs.prompts_per_step} prompts x {inputs.samples_per_prompt} samples of up to "
             f"{rollout.prompt_length} + {rollout.response_length} tokens", "",
             "per GPU, by role (largest pipeline stage):",
             f"  {'role':8} {'stage':>5} {'weights':>10} {'grads':>10} {'optimizer':>10} {'activations':>12} "
             f"{'logits':>10} {'forward':>10}"]
    for name, r in mem.roles.items():
        role = inputs.role(name)
        lines.append(f"  {name:8} {r.stage:5} {_gb(r.params):>10} {_gb(r.grads):>10} {_gb(r.optimizer):>10} "
                     f"{_gb(r.activations):>12} {_gb(r.logits):>10} {_gb(r.forward):>10}   "
                     + (role.recompute.describe() if role.train is not None else "forward only"))
    e = mem.engine
    lines += ["", f"vLLM worker: budget {_gb(e.budget).strip()} (gpu_memory_utilization {rollout.gpu_memory_utilization}) ="
                  f" weights {_gb(e.weights).strip()} + activations {_gb(e.activations).strip()} + CUDA context "
                  f"{_gb(e.context).strip()} + KV cache {_gb(max(0, e.kv_cache)).strip()}",
              f"  KV cache: {e.kv_bytes_per_token / 1024:.0f} KiB per token -> {e.concurrent_sequences} sequences of "
              f"{e.sequence_length} tokens at once; a replica generates {mem.sequences_per_replica} per step "
              f"({t.generation.waves} wave(s))", "",
              f"per GPU, by phase ({'trainer rank + vLLM worker' if placement.mode == 'colocated' else 'split GPUs'}):"]
    for phase in mem.phases:
        verdict = "ok" if phase.total <= mem.capacity else "DOES NOT FIT"
        parts = ", ".join(f"{what} {b / GB:.1f}" for what, b in sorted(phase.items, key=lambda i: -i[1]) if b)
        label = phase.phase if phase.gpu == "colocated" else f"{phase.phase} ({phase.gpu})"
        lines.append(f"  {label:24} {_gb(phase.total)} of {mem.capacity / GB:.0f} GB  {verdict:12}  [GB: {parts}]")
    g = t.generation
    lines += ["", f"time per step (upper bound: every response {rollout.response_length} tokens):",
              f"  {'generate':14} {_s(g.seconds)}   prefill {_s(g.prefill_s).strip()}; {g.waves} wave(s) x "
              f"{rollout.response_length} decode steps of {g.step_s * 1e3:.1f} ms ({g.concurrent} sequences, "
              f"{g.bound}-bound)"]
    for name, seconds in t.passes.items():
        lines.append(f"  {name:14} {_s(seconds)}   {t.flops[name] / 1e15:.1f} PFLOP")
    if t.sync is not None:
        ib, nv = hw.ib_gbps * GB * eff.link, hw.nvlink_gbps * GB * eff.link
        slot, busiest = t.sync.busiest_gpu(ib, nv)
        lines.append(f"  {'sync':14} {_s(t.sync_s)}   {t.sync.bytes_sent / GB:.1f} GB leave the trainer (each byte once), "
                     f"{t.sync.bytes_delivered / GB:.1f} GB arrive; busiest GPU {slot}: network in "
                     f"{busiest.ib_in / GB:.1f} / out {busiest.ib_out / GB:.1f} GB, NVLink in {busiest.nvlink_in / GB:.1f} GB")
    lines.append(f"  {'step':14} {_s(t.step_s)}")
    lines += _packing_lines(plan)
    lines.append("")
    if plan.fits:
        lines.append(f"fits: every phase fits in {mem.capacity / GB:.0f} GB per GPU")
    else:
        lines.append("DOES NOT FIT:")
        for f in plan.findings:
            lines.append(f"  - {f.message}")
            if f.fixes:
                lines.append(f"    any one of these makes it fit: {'; '.join(f.fixes)}")
            elif f.helps:
                lines.append(f"    none alone makes it fit; these help: {'; '.join(f.helps)}")
        together = plan.findings[0].together
        if together:
            lines.append(f"  together these make the run fit: {'; '.join(together)}")
    return "\n".join(lines)


def _packing_lines(plan) -> list[str]:
    if not plan.packing:
        return []
    rollout = plan.inputs.rollout
    lines = ["", f"sequence packing, per rank and step, at responses log-normal around a median of {plan.response_median} "
                 f"tokens (sigma 1, at most {rollout.response_length}) after {rollout.prompt_length}-token prompts:"]
    for p in plan.packing:
        state = "packed" if p.packed else "padded (use_remove_padding=False)"
        lines.append(f"  {p.name:16} real {p.real_tokens:12,.0f} tokens, padded {p.padded_tokens:12,.0f} ({p.ratio:.2f}x); "
                     f"largest micro-batch {p.largest_packed:,.0f} vs {p.largest_padded:,.0f} tokens; this run: {state}")
    return lines


def as_dict(plan) -> dict:
    inputs, mem, t = plan.inputs, plan.memory, plan.time
    model = inputs.role("actor").model
    lay = inputs.layout
    return {
        **figures(plan.hardware, plan.efficiency),
        "model": {"architecture": model.dims.architecture, "parameters": model.hf_params, "active_parameters": model.active_params,
                  "vision_parameters": model.vision_params},
        "layout": {"trainer": {"tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "ep": lay.ep, "etp": lay.etp, "cp": inputs.cp,
                               "dp": inputs.dp,
                               "sequence_parallel": lay.sequence_parallel, "gpus": inputs.trainer_world},
                   "rollout": {"replicas": inputs.rollout.replicas, "tp": inputs.rollout.tp},
                   "placement": inputs.placement.mode},
        "roles": {name: asdict(r) for name, r in mem.roles.items()},
        "vllm": {**asdict(mem.engine), "kv_cache": mem.engine.kv_cache,
                 "concurrent_sequences": mem.engine.concurrent_sequences, "sequences_per_replica": mem.sequences_per_replica},
        "phases": [{"phase": p.phase, "gpu": p.gpu, "bytes": p.total, "fits": p.total <= mem.capacity,
                    "items": dict(p.items)} for p in mem.phases],
        "capacity_bytes": mem.capacity,
        "time_s": {"generate": t.generation.seconds, **t.passes, "sync": t.sync_s, "step": t.step_s},
        "generation": asdict(t.generation),
        "sync": {"bytes_sent": t.sync.bytes_sent, "bytes_delivered": t.sync.bytes_delivered} if t.sync else None,
        "fits": plan.fits,
        "findings": [asdict(f) for f in plan.findings],
        "packing": {"response_median": plan.response_median,
                    "passes": [{**asdict(p), "ratio": p.ratio} for p in plan.packing]} if plan.packing else None,
    }


def to_json(plan) -> str:
    return json.dumps(as_dict(plan), indent=2, default=str)


def config_comment(plan, config: str) -> list[str]:
    """The memory plan a packaged config carries in its header comment (``megarl plan`` output)."""
    inputs, mem, t, hw = plan.inputs, plan.memory, plan.time, plan.hardware
    lines = [f"# Memory plan per GPU (`megarl plan {config}` on {hw.name}, {hw.memory_gb:.0f} GB; the largest",
             "# pipeline stage; regenerate it after changing the layout, tests/plan/test_plan_published.py checks it):"]
    for name, r in mem.roles.items():
        role = inputs.role(name)
        if role.train is None:
            lines.append(f"#   {name:8} weights {r.params / GB:.1f} GB (forward only)")
        else:
            lines.append(f"#   {name:8} weights {r.params / GB:.1f} GB, grads {r.grads / GB:.1f} GB, optimizer "
                         f"{r.optimizer / GB:.1f} GB, activations {r.activations / GB:.1f} GB, logits {r.logits / GB:.1f} GB "
                         f"({role.recompute.describe()})")
    e = mem.engine
    lines.append(f"#   {'vLLM':8} weights {e.weights / GB:.1f} GB + KV cache {max(0, e.kv_cache) / GB:.1f} GB in "
                 f"gpu_memory_utilization {inputs.rollout.gpu_memory_utilization}: {e.concurrent_sequences} sequences of "
                 f"{e.sequence_length} tokens at once")
    phases = [f"{p.phase} {p.total / GB:.1f}" + ("" if p.gpu == "colocated" else f" ({p.gpu})") for p in mem.phases]
    lines.append(f"#   phases   {', '.join(phases)} GB: " + ("all fit" if plan.fits else "DOES NOT FIT"))
    passes = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in t.passes.items())
    lines.append(f"#   time     at most {t.step_s:.0f} s a step: generate {t.generation.seconds:.0f} s, {passes}, sync "
                 f"{t.sync_s:.1f} s ({t.sync.bytes_sent / GB:.0f} GB leave the trainer)")
    return lines
