"""The memory a shared-prefill job asks SLURM for, from the memory planner.

Before ``hydra/sweeper=shared_prefill`` launches through ``hydra/launcher=slurm``, it plans each job:
its settings together (``snapkv.memory.plan_shared``) at the longest input the job can meet (the
model's ``max_length``, to which LongBench truncates every prompt; the longest length of a needle or
lines grid) with the task's longest answer.

- A CPU job (``device=cpu``, or ``device=auto`` with ``gpus_per_node`` 0) asks for host memory
  ``mem_gb = ceil(planned peak x SAFETY + RUNTIME_GIB)``, but never less than the configured
  ``mem_gb``: the configured value is a floor.
- A GPU job keeps the configured ``mem_gb``; its planned GPU peak is printed, against
  ``hydra.sweeper.gpu_memory_gib`` x GPUs per node when that is set, and a job over it is refused.

A job whose model cannot be planned (an architecture the planner does not know, no config on this
machine: nothing is downloaded) keeps the configured request, and its line says why. One SLURM
array has one request: the largest of its jobs' (``array_mem_gb``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import OmegaConf

from snapkv.errors import InputError
from snapkv.memory import plan_shared

# The planner follows a measured CPU peak to 15% in its growth with length and 25% in the peak itself
# (tests/test_bench.py); the factor is a margin over that.
SAFETY = 1.25
# What a job holds beside the planned tensors: Python, torch and transformers, the tokenizer, the data.
RUNTIME_GIB = 3


@dataclass
class Request:
    mem_gb: int | None   # host memory to ask for (None: the launcher's default)
    line: str            # what was planned, one line for the sweep's log


def offline_architecture(model_cfg) -> dict:
    """The model's architecture without weights or the network: the config's ``architecture``, the
    GGUF's header of a ``package_file``, or a ``config.json`` already on this machine."""
    from transformers import AutoConfig
    from .runner import model_architecture, packaged_file
    if model_cfg.get("architecture"):
        return model_architecture(model_cfg)
    if model_cfg.get("package_file"):
        gguf = packaged_file(model_cfg.package_file)
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).to_dict()
    if model_cfg.get("path"):
        revision = {"revision": str(model_cfg.revision)} if model_cfg.get("revision") else {}
        try:
            return AutoConfig.from_pretrained(str(model_cfg.path), local_files_only=True, **revision).to_dict()
        except OSError:
            raise InputError(f"model.path={model_cfg.path}: no config.json of it on this machine (nothing is "
                             "downloaded to plan)") from None
    raise InputError(f"model {model_cfg.get('name')!r} has no architecture, package_file or path to plan from")


def longest_input(cfg) -> tuple[int, int]:
    """``(prompt tokens, new tokens)`` of the longest item the job's task can give it."""
    if cfg.task == "longbench":
        from .longbench.prompt import generation_length
        lb = cfg.longbench
        return int(cfg.model.max_length), max(generation_length(d, lb.max_new_tokens) for d in lb.datasets)
    if cfg.task in ("needle", "lines"):
        from .needle.grid import lengths_from
        section = cfg[cfg.task]
        return max(lengths_from(section)), int(section.max_new_tokens)
    raise InputError(f"task={cfg.task!r} has no longest input to plan at (longbench, needle and lines have)")


def planned_peak(cfg, compressors: list) -> tuple[int, int]:
    """The planned peak bytes of the job's settings sharing one prefill, and the input length."""
    from .runner import chunking
    length, new_tokens = longest_input(cfg)
    model = cfg.model
    dtype = model.dtype if model.dtype != "auto" else "bfloat16"
    together = bool((cfg.get("shared_prefill") or {}).get("decode_together", False))
    planned = plan_shared(offline_architecture(model), length, compressors, dtype=dtype,
                          attn_implementation=model.get("attn_implementation", "sdpa"),
                          **chunking(model), decode_tokens=new_tokens, decode_together=together)
    return planned["peak_bytes"], length


def on_gpu(cfg, launcher: dict) -> bool:
    device = str(cfg.get("device") or "auto")
    if device == "auto":
        return int(launcher.get("gpus_per_node") or 0) > 0
    return device != "cpu"


def gpu_limit_gib(gpu_memory_gib, launcher: dict) -> float:
    if isinstance(gpu_memory_gib, bool) or not isinstance(gpu_memory_gib, (int, float)) or gpu_memory_gib <= 0:
        raise InputError(f"hydra.sweeper.gpu_memory_gib={gpu_memory_gib!r} must be a positive number "
                         "(GiB of one GPU), or null")
    return float(gpu_memory_gib) * max(1, int(launcher.get("gpus_per_node") or 1))


def job_memory(cfg, compressors: list, launcher: dict, gpu_memory_gib=None) -> Request:
    """The request of one job: its composed config, its settings, the launcher's parameters."""
    configured = launcher.get("mem_gb")
    name = f"{cfg.model.name}, {len(compressors)} setting(s)"
    try:
        peak, length = planned_peak(cfg, compressors)
    except (ValueError, OSError, KeyError, ImportError) as exc:
        reason = " ".join(str(exc).split())[:300]
        return Request(configured, f"{name}: not planned ({reason}); mem_gb={configured} as configured")
    gib = peak / 2**30
    at = f"at {length} tokens"
    if on_gpu(cfg, launcher):
        if gpu_memory_gib is None:
            return Request(configured, f"{name}: planned GPU peak {gib:.1f} GiB {at} "
                                       "(hydra.sweeper.gpu_memory_gib=GIB checks it against the GPU)")
        limit = gpu_limit_gib(gpu_memory_gib, launcher)
        if gib > limit:
            raise InputError(f"hydra.sweeper.gpu_memory_gib={gpu_memory_gib}: {name} plans a GPU peak of {gib:.1f} "
                             f"GiB {at}, more than the job's {limit:g} GiB; give it more GPUs "
                             "(hydra.launcher.gpus_per_node) or a shorter longest input")
        return Request(configured, f"{name}: planned GPU peak {gib:.1f} of {limit:g} GiB {at}")
    needed = math.ceil(gib * SAFETY + RUNTIME_GIB)
    mem_gb = needed if configured is None else max(needed, int(configured))
    return Request(mem_gb, f"{name}: planned host peak {gib:.2f} GiB {at}; x {SAFETY} + {RUNTIME_GIB} GiB = "
                           f"{needed} GiB, configured {configured} -> mem_gb={mem_gb}")


def group_request(members: list, compose, launcher: dict, gpu_memory_gib=None) -> Request:
    """``job_memory`` of a sweeper group (``eval.sweep_groups.Member`` list; ``compose``: overrides -> config)."""
    from .hydra_app import make_compressor
    cfg = compose(members[0].overrides)
    return job_memory(cfg, [make_compressor(OmegaConf.create(m.compressor)) for m in members], launcher,
                      gpu_memory_gib)


def array_mem_gb(requests: list[Request], configured: int | None) -> int | None:
    """One SLURM array, one request: the largest of its jobs'."""
    asked = [r.mem_gb for r in requests if r.mem_gb is not None]
    return max(asked) if asked else configured
