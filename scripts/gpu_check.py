"""The paper's claims on a real accelerator, in one command: python scripts/gpu_check.py [--smoke] [--out DIR].

Eight independent sections, each with its own time budget (a failure or an overrun is recorded and the
next section runs); random-weight models built on the device (no download); a Markdown report and
JSON written after every section to ``--out`` (default ``results/gpu_check``):

1. environment: versions, the device, which attention implementations load, dtype support;
2. exactness: SnapKV's kept positions through the hooks equal the pure selection (``snapkv.select``)
   per implementation and dtype, and greedy continuations compared across implementations;
3. speed: decode latency per token at 16K, batch 1 and 2, full KV vs SnapKV 2048 (the paper's
   Figure 7 protocol, ``experiment=speed_memory``; paper: 3.6x at batch 2), and the empty-cache floor;
4. memory: the longest input under an 80 GiB cap at batch 2, full KV vs SnapKV 2048 (paper: 8.2x;
   full fails beyond ~16K, SnapKV reaches 131K), with the planner's frontier beside it; the
   planner's prefill peak against ``max_memory_allocated`` for the five methods at 16K;
5. long context: one SnapKV 1024 prefill + 16 decoded tokens at the longest length the budget allows,
   up to 380K (paper: 380K on one A100-80GB), with peak memory;
6. shared prefill: Table 1's five settings on one prompt, five solo runs against one shared prefill
   (exact: every setting's tokens compared);
7. head-adaptive: AdaKV's ragged cache against SnapKV at budget 1024 and 7K tokens: KV bytes (beside
   what padding to the longest head and kvpress's masking would hold), decoding time and peak memory;
8. items: items in flight (``batch.items=auto``) against one item at a time, items per second.

``--smoke`` runs every section on CPU with tiny shapes (the test suite runs it, so the script
cannot rot). The full mode needs about 10 minutes on one H100/H200-class GPU.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import signal
import statistics
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402

import snapkv  # noqa: E402
from eval.bench.sweep import agreement, scaled  # noqa: E402
from eval.decoding import sync  # noqa: E402
from eval.runner import Runner, free_memory, is_oom  # noqa: E402
from snapkv import memory  # noqa: E402
from snapkv.architectures import window_queries  # noqa: E402
from snapkv.transformers_workarounds import cache_argument  # noqa: E402
from snapkv.select import snapkv_scores, top_positions  # noqa: E402

GIB = 2**30
# Seconds per section in the full mode (the smoke mode gives each a quarter of these).
BUDGETS_S = {"environment": 20, "exactness": 70, "speed": 60, "memory": 120, "long_context": 140,
             "shared_prefill": 50, "head_adaptive": 40, "items": 90, "long_generation": 240, "prefill_limit": 150,
             "speculative": 120}
TABLE1 = [snapkv.FullKV(), snapkv.SnapKV(budget=1024), snapkv.SnapKV(budget=2048),
          snapkv.SnapKV(budget=4096), snapkv.H2O(budget=4096)]


def lwm_architecture() -> dict:
    """The LWM-Text-Chat-1M shape, read from the project's own model config."""
    return dict(yaml.safe_load((ROOT / "conf" / "model" / "lwm-1m.yaml").read_text())["architecture"])


class Mode:
    """Shapes, lengths and device of one run (full: the paper's sizes on CUDA; smoke: tiny on CPU)."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.device = "cpu" if smoke or not torch.cuda.is_available() else "cuda"
        self.dtype = torch.float32 if self.device == "cpu" else torch.float16
        lwm = lwm_architecture()
        if smoke:
            lwm.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=256)
        self.lwm = lwm
        gqa = dict(lwm, num_key_value_heads=lwm["num_attention_heads"] // 4, intermediate_size=14336,
                   num_hidden_layers=4, vocab_size=lwm["vocab_size"])
        if smoke:
            gqa.update(intermediate_size=128, num_hidden_layers=2)
        self.shapes = {"llama-7b (MHA, 4 layers)": dict(lwm, num_hidden_layers=2 if smoke else 4),
                       "llama-3-8b-like (GQA 4:1, 4 layers)": gqa}
        scale = 1 / 32 if smoke else 1
        self.exact_length = 320 if smoke else 4096
        self.speed_length = int(16384 * scale)
        self.speed_budget = int(2048 * scale)
        self.decode_tokens = 8 if smoke else 64
        self.repeats = 3
        self.cap_bytes = int((64 * 2**20) if smoke else 80 * GIB)
        self.memory_budget = int(2048 * scale)
        self.frontier_max = int(262144 * scale)
        self.long_lengths = [int(n * scale) for n in (32768, 65536, 131072, 262144, 380000)]
        self.long_budget = int(1024 * scale)
        self.mlp_chunk = int(16384 * scale)
        self.shared_length = int(8192 * scale)
        self.shared_answer = 16 if smoke else 64
        self.head_adaptive_length = int(7168 * scale)
        self.budgets = {k: v / 4 if smoke else v for k, v in BUDGETS_S.items()}

    def scaled(self, cfg):
        """A paper setting with its budget scaled to the mode's lengths (unchanged in the full mode)."""
        return scaled([cfg], 1 / 32 if self.smoke else 1)[0]


# -- measuring ---------------------------------------------------------------------------------

class PeakMeter:
    """Peak bytes above a baseline: ``max_memory_allocated`` on CUDA, sampled resident memory on CPU."""

    def __init__(self, device: str):
        self.device = device

    def __enter__(self):
        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            import psutil
            process = psutil.Process()
            self.base = self.peak = process.memory_info().rss
            self._stop = threading.Event()

            def sample():
                while not self._stop.wait(0.002):
                    self.peak = max(self.peak, process.memory_info().rss)
            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self._stop.set()
            self._thread.join()
        return False

    @property
    def above_base(self) -> int:
        return int(self.peak - self.base)


def build_model(arch: dict, mode: Mode, attn: str, sharpen: bool = False):
    from transformers import AutoConfig, AutoModelForCausalLM
    spec = dict(arch)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    with torch.device(mode.device):
        model = AutoModelForCausalLM.from_config(config, dtype=mode.dtype, attn_implementation=attn)
    if sharpen:  # random init attends almost uniformly: sharpen it so that selection means something
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(4.0)
                layer.self_attn.k_proj.weight.mul_(4.0)
    return model.eval()


def set_attention(model, attn: str) -> None:
    model.set_attn_implementation(attn)


def implementations(device: str) -> list[str]:
    impls = ["eager", "sdpa"]
    if device == "cuda":
        try:
            import flash_attn  # noqa: F401
            impls.append("flash_attention_2")
        except ImportError:
            pass
    return impls


def tokens(batch: int, length: int, vocab: int, device: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=gen).to(device)


class SectionTimeout(Exception):
    pass


@contextmanager
def hard_limit(seconds: float):
    """Raise ``SectionTimeout`` once ``seconds`` have passed (between Python bytecodes: a kernel in
    flight finishes first). Sections also check their own deadline before each step."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise SectionTimeout(f"hard limit of {seconds:.0f} s reached")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Clock:
    def __init__(self, budget_s: float):
        self.start, self.budget = time.perf_counter(), budget_s

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)


# -- sections ----------------------------------------------------------------------------------

def section_environment(mode: Mode, clock: Clock) -> dict:
    import transformers
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformers": transformers.__version__, "device": mode.device}
    if mode.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / GIB, 1), bf16=torch.cuda.is_bf16_supported())
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ a
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
        out["bf16_matmul_tflops"] = round(10 * 2 * 8192**3 / (time.perf_counter() - start) / 1e12, 1)
        del a
    try:
        import flash_attn
        out["flash_attn"] = flash_attn.__version__
    except ImportError as exc:
        out["flash_attn"] = f"not importable ({exc}); flash_attention_2 is not checked"
    tiny = dict(mode.lwm, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=256)
    loads = {}
    for attn in ("eager", "sdpa", "flash_attention_2"):
        for dtype in ((torch.float16, torch.bfloat16) if mode.device == "cuda" else (torch.float32,)):
            name = f"{attn}/{str(dtype).removeprefix('torch.')}"
            try:
                model = build_model(tiny, mode, attn)
                model.to(dtype)
                with torch.no_grad():
                    logits = model(tokens(1, 16, 256, mode.device)).logits
                loads[name] = "ok" if torch.isfinite(logits).all() else "non-finite logits"
            except Exception as exc:  # the point is to report which ones do not load
                loads[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    out["attention_implementations"] = loads
    return out


def _capture_full_prefill(model, cfg, ids):
    """Run a compressed prefill, recording per layer the full keys and the window queries, and the
    earlier positions the hooks kept (``snapkv.kept_positions`` less the window)."""
    captured, handles = {}, []

    def before(module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        captured[module.layer_idx] = {"queries": window_queries(module, hidden, kwargs["position_embeddings"],
                                                                 cfg.window), "scaling": module.scaling}

    def after(module, args, kwargs, output):
        captured[module.layer_idx]["keys"] = cache_argument(kwargs).layers[module.layer_idx].keys

    for layer in model.model.layers:  # registered before the session's hooks: they see the full KV
        handles.append(layer.self_attn.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(layer.self_attn.register_forward_hook(after, with_kwargs=True))
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    try:
        with snapkv.compress(model, cfg), torch.no_grad():
            model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    device = ids.device
    kept = [torch.stack([torch.stack(heads) for heads in rows]).to(device)[..., :-cfg.window]
            for rows in snapkv.kept_positions(cache)]
    return kept, captured


def compare_selection(kept, captured, cfg) -> dict:
    """Heads whose kept set equals the pure selection; those that differ only among tied scores."""
    equal = tied = differ = 0
    for idx, hooked in enumerate(kept):
        layer = captured[idx]
        scores = snapkv_scores(layer["queries"], layer["keys"], cfg, None, layer["scaling"])
        pure = top_positions(scores, cfg.budget - cfg.window)
        same = (pure == hooked).all(dim=-1)
        equal += int(same.sum())
        for b, h in (~same).nonzero().tolist():
            row = scores[b, h]
            if torch.equal(row[pure[b, h]].sort().values, row[hooked[b, h]].sort().values):
                tied += 1
            else:
                differ += 1
    return {"heads_equal": equal, "heads_differing_by_ties": tied, "heads_differing": differ}


def section_exactness(mode: Mode, clock: Clock) -> dict:
    cfg = mode.scaled(snapkv.SnapKV(budget=1024, window=32, kernel=7))
    dtypes = [torch.float32] if mode.device == "cpu" else [torch.bfloat16, torch.float16]
    out = {"setting": cfg.label(), "input_tokens": mode.exact_length, "cases": []}
    for shape_name, arch in mode.shapes.items():
        model = build_model(arch, mode, "eager", sharpen=True)
        ids = tokens(1, mode.exact_length, arch["vocab_size"], mode.device, seed=1)
        for dtype in dtypes:
            model.to(dtype)
            continuations = {}
            for attn in implementations(mode.device):
                if clock.left() < 5:
                    out["cases"].append({"shape": shape_name, "dtype": str(dtype), "attn": attn,
                                         "skipped": "section time budget"})
                    continue
                set_attention(model, attn)
                kept, captured = _capture_full_prefill(model, cfg, ids)
                case = {"shape": shape_name, "dtype": str(dtype).removeprefix("torch."), "attn": attn,
                        **compare_selection(kept, captured, cfg)}
                del kept, captured
                gen = Runner(model).generate(ids, cfg, 32)
                continuations[attn] = gen.tokens
                out["cases"].append(case)
            reference = continuations.get("eager")
            for case in out["cases"]:
                if case.get("shape") == shape_name and case.get("dtype") == str(dtype).removeprefix("torch.") \
                        and reference and case["attn"] in continuations:
                    mine = continuations[case["attn"]]
                    agree = sum(a == b for a, b in zip(mine, reference))
                    first = next((i for i, (a, b) in enumerate(zip(mine, reference)) if a != b), None)
                    case.update(tokens_agreeing_with_eager=f"{agree}/{len(reference)}",
                                first_divergence=first)
        del model
        free_memory()
    cases = [c for c in out["cases"] if "heads_equal" in c]
    out["all_selections_exact"] = bool(cases) and all(c["heads_differing"] == 0 for c in cases)
    return out


_LWM_MODELS: dict = {}


def lwm_model(mode: Mode):
    """The random LWM-7B-shaped model in the mode's dtype (built once; sdpa, or flash-attn if present)."""
    if "model" not in _LWM_MODELS:
        attn = "flash_attention_2" if "flash_attention_2" in implementations(mode.device) else "sdpa"
        _LWM_MODELS["model"] = build_model(mode.lwm, mode, attn)
        _LWM_MODELS["attn"] = attn
    return _LWM_MODELS["model"]


def decode_latency(runner, ids, cfg, mode: Mode) -> dict:
    runner.generate(ids[:, : min(ids.shape[1], 64)], snapkv.FullKV(), 2)  # warm-up
    prefill, decode = [], []
    for _ in range(mode.repeats):
        gen = runner.generate(ids, cfg, mode.decode_tokens)
        prefill.append(gen.prefill_s)
        decode.append(gen.decode_s_per_token)
    return {"prefill_s": round(statistics.median(prefill), 4),
            "decode_ms_per_token": round(1000 * statistics.median(decode), 3)}


def section_speed(mode: Mode, clock: Clock) -> dict:
    model = lwm_model(mode)
    runner = Runner(model, mlp_chunk=mode.mlp_chunk)
    snap = mode.scaled(snapkv.SnapKV(budget=2048))
    out = {"model": f"random LWM-7B shape, {str(mode.dtype).removeprefix('torch.')}, {_LWM_MODELS['attn']}",
           "input_tokens": mode.speed_length, "decode_tokens": mode.decode_tokens, "repeats": mode.repeats,
           "rows": []}
    vocab = mode.lwm["vocab_size"]
    for batch in (1, 2):
        if clock.left() < 5:
            out["rows"].append({"batch": batch, "skipped": "section time budget"})
            continue
        ids = tokens(batch, mode.speed_length, vocab, mode.device)
        floor = decode_latency(runner, ids[:, :1], snapkv.FullKV(), mode)
        full = decode_latency(runner, ids, snapkv.FullKV(), mode)
        compressed = decode_latency(runner, ids, snap, mode)
        out["rows"].append({"batch": batch, "full": full, snap.label(): compressed, "empty_cache": floor,
                            "decode_speedup": round(full["decode_ms_per_token"] /
                                                    compressed["decode_ms_per_token"], 2)})
    out["paper"] = "3.6x decode speed at 16K, batch 2 (LWM-7B, A100-80GB, SnapKV 2048)"
    return out


def fits(runner, cfg, batch: int, length: int, mode: Mode, cap: int) -> tuple[bool, int]:
    """One probe: prefill + a few decoded tokens; (no OOM and under the cap, peak above the model)."""
    ids = tokens(batch, length, mode.lwm["vocab_size"], mode.device)
    try:
        with PeakMeter(mode.device) as meter:
            runner.generate(ids, cfg, 4)
        return meter.above_base + (meter.base if mode.device == "cuda" else 0) <= cap, meter.above_base
    except Exception as exc:
        if not is_oom(exc):
            raise
        return False, -1
    finally:
        del ids
        free_memory()


def frontier(runner, cfg, batch, start, mode: Mode, cap: int, clock: Clock, reserve_s: float) -> dict:
    """Longest fitting input found by steps of 1.25x from ``start`` (up, then bisection), probes
    bounded by the section's clock (``reserve_s`` left for what follows)."""
    probes, lo, hi = [], 0, None
    length = max(64, int(start))
    while clock.left() > reserve_s and length <= mode.frontier_max:
        began = time.perf_counter()
        ok, peak = fits(runner, cfg, batch, length, mode, cap)
        probes.append({"input_tokens": length, "fits": ok, "peak_above_model_gib": round(peak / GIB, 3),
                       "s": round(time.perf_counter() - began, 2)})
        if ok:
            lo = max(lo, length)
        else:
            hi = length if hi is None else min(hi, length)
        if hi is None:
            length = int(length * 1.25)
        elif lo == 0:
            length = int(length / 1.25)
            if length < 64:
                break
        elif hi / lo <= 1.05:
            break
        else:
            length = (lo + hi) // 2
    bracket = f"fits {lo}" + (f", fails {hi}" if hi else f" (not probed past {mode.frontier_max})")
    return {"longest_fitting": lo, "first_failing": hi, "bracket": bracket, "probes": probes}


def section_memory(mode: Mode, clock: Clock) -> dict:
    model = lwm_model(mode)
    runner = Runner(model, mlp_chunk=mode.mlp_chunk)
    attn, dtype = _LWM_MODELS["attn"], str(mode.dtype).removeprefix("torch.")
    planned_attn = "eager" if attn == "eager" else "sdpa"
    cap = mode.cap_bytes
    snap = mode.scaled(snapkv.SnapKV(budget=2048))
    out = {"cap_gib": round(cap / GIB, 3), "batch": 2, "model": f"random LWM-7B shape, {dtype}, {attn}"}
    previous_fraction = None
    if mode.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        previous_fraction = 1.0
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
        cap_check = cap
    else:
        cap_check = cap + 0  # CPU: the resident memory above the model must stay under the cap
    try:
        rows = {}
        for name, cfg, reserve in (("full", snapkv.FullKV(), clock.budget * 0.6),
                                   (snap.label(), snap, clock.budget * 0.2)):
            plan_kw = dict(batch=2, dtype=dtype, attn_implementation=planned_attn, mlp_chunk=mode.mlp_chunk,
                           decode_tokens=4)
            budget_for_kv = cap if mode.device == "cuda" else cap + memory.plan(
                mode.lwm, 1, None, **plan_kw)["weights_bytes"]
            planned = memory.longest_fitting(mode.lwm, budget_for_kv, cfg if cfg.compresses else None,
                                             limit=mode.frontier_max, **plan_kw)
            found = frontier(runner, cfg, 2, planned or 1024, mode, cap_check, clock, reserve)
            found["planned_longest"] = planned
            if found["longest_fitting"]:
                error = (planned - found["longest_fitting"]) / found["longest_fitting"]
                found["planner_error"] = f"{100 * error:+.1f}%"
            rows[name] = found
        out["frontier"] = rows
        full_len, snap_len = rows["full"]["longest_fitting"], rows[snap.label()]["longest_fitting"]
        out["ratio"] = round(snap_len / full_len, 2) if full_len else None
    finally:
        if previous_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(previous_fraction)
    out["paper"] = "8.2x (full KV fails beyond ~16K at batch 2; SnapKV 2048 reaches 131K; A100-80GB)"
    # the planner's prefill peak against the measured one, five methods at 16K, batch 1
    planner_rows = []
    length = mode.speed_length
    ids = tokens(1, length, mode.lwm["vocab_size"], mode.device)
    for cfg in [snapkv.FullKV(), snap, mode.scaled(snapkv.PyramidKV(budget=2048)),
                mode.scaled(snapkv.H2O(budget=2048)), mode.scaled(snapkv.StreamingLLM(budget=2048))]:
        if clock.left() < 3:
            planner_rows.append({"setting": cfg.label(), "skipped": "section time budget"})
            continue
        with PeakMeter(mode.device) as meter:
            runner.generate(ids, cfg, 1)
        planned = memory.plan(mode.lwm, length, cfg if cfg.compresses else None, batch=1, dtype=dtype,
                              attn_implementation=planned_attn, mlp_chunk=mode.mlp_chunk)
        above = planned["prefill_peak_bytes"] - planned["weights_bytes"]
        planner_rows.append({"setting": cfg.label(), "measured_gib": round(meter.above_base / GIB, 3),
                             "planned_gib": round(above / GIB, 3),
                             "planner_error": f"{100 * (above - meter.above_base) / max(meter.above_base, 1):+.1f}%"})
    out["planner_at_16k"] = {"input_tokens": length, "rows": planner_rows}
    return out


def predicted_prefill_s(times: dict, length: int) -> float:
    """A prefill's seconds at ``length``: ``a*L + b*L^2`` fitted on the last two of ``{length: seconds}``."""
    (l1, t1), (l2, t2) = sorted(times.items())[-2:]
    b = max((t2 / l2 - t1 / l1) / (l2 - l1), 0.0)
    return max(t2 / l2 - b * l2, 0.0) * length + b * length**2


def section_long_context(mode: Mode, clock: Clock) -> dict:
    model = lwm_model(mode)
    runner = Runner(model, mlp_chunk=mode.mlp_chunk)
    cfg = mode.scaled(snapkv.SnapKV(budget=1024, window=16, kernel=5, pooling="maxpool"))
    out = {"setting": cfg.label(), "decode_tokens": 16, "runs": []}
    times = {}
    for length in mode.long_lengths:
        if len(times) >= 2:
            predicted = predicted_prefill_s(times, length)
            if predicted > clock.left() - 5:
                out["runs"].append({"input_tokens": length, "skipped": f"predicted {predicted:.0f} s, "
                                                                       f"{clock.left():.0f} s left"})
                continue
        ids = tokens(1, length, mode.lwm["vocab_size"], mode.device)
        try:
            with PeakMeter(mode.device) as meter:
                gen = runner.generate(ids, cfg, 16)
            times[length] = gen.prefill_s
            out["runs"].append({"input_tokens": length, "prefill_s": round(gen.prefill_s, 2),
                                "decode_ms_per_token": round(1000 * gen.decode_s_per_token, 2),
                                "peak_gib": round((meter.above_base + (meter.base if mode.device == 'cuda' else 0))
                                                  / GIB, 2), "cache_tokens_per_layer": max(gen.cache_lengths)})
        except Exception as exc:
            if not is_oom(exc):
                raise
            out["runs"].append({"input_tokens": length, "oom": True})
            break
        finally:
            del ids
            free_memory()
    done = [r["input_tokens"] for r in out["runs"] if "prefill_s" in r]
    out["longest_run"] = max(done) if done else None
    out["paper"] = "380K tokens on one A100-80GB (LWM-Text-Chat-1M, SnapKV 1024)"
    return out


def section_shared_prefill(mode: Mode, clock: Clock) -> dict:
    model = lwm_model(mode)
    runner = Runner(model, mlp_chunk=mode.mlp_chunk)
    settings = [mode.scaled(cfg) for cfg in TABLE1]
    ids = tokens(1, mode.shared_length, mode.lwm["vocab_size"], mode.device, seed=2)
    runner.generate(ids[:, :64], snapkv.FullKV(), 2)  # warm-up
    sync(mode.device)
    start = time.perf_counter()
    solo = [runner.generate(ids, cfg, mode.shared_answer) for cfg in settings]
    sync(mode.device)
    solo_s = time.perf_counter() - start
    start = time.perf_counter()
    shared = runner.generate_shared(ids, settings, mode.shared_answer)
    sync(mode.device)
    shared_s = time.perf_counter() - start
    start = time.perf_counter()
    together = runner.generate_shared(ids, settings, mode.shared_answer, together=True)
    sync(mode.device)
    together_s = time.perf_counter() - start
    differ, agree = agreement([g.tokens for g in shared], [g.tokens for g in together])
    full_prefill = solo[0].prefill_s
    return {"input_tokens": mode.shared_length, "answer_tokens": mode.shared_answer,
            "settings": [cfg.label() for cfg in settings],
            "solo_s": round(solo_s, 3), "shared_s": round(shared_s, 3), "speedup": round(solo_s / shared_s, 2),
            "ideal_s": round(shared[0].prefill_s + sum(g.decode_s for g in shared), 3),
            "prefill_relative_to_full": {cfg.label(): round(g.prefill_s / full_prefill, 2)
                                         for cfg, g in zip(settings, solo)},
            "tokens_equal_to_solo": {cfg.label(): a.tokens == b.tokens for cfg, a, b in zip(settings, solo, shared)},
            "together_s": round(together_s, 3), "together_speedup": round(solo_s / together_s, 2),
            "together_answers_differ": differ, "together_token_agreement": round(agree, 4)}


def section_head_adaptive(mode: Mode, clock: Clock) -> dict:
    """AdaKV's ragged cache against SnapKV at the same average budget (1024 at 7K tokens), on an 8-layer
    GQA 4:1 model of LWM-7B's width: KV bytes (and what the same selection would hold padded to the
    longest head and masked as kvpress keeps it), decoding time per token and peak memory, as ratios."""
    arch = dict(mode.shapes["llama-3-8b-like (GQA 4:1, 4 layers)"], num_hidden_layers=2 if mode.smoke else 8)
    if mode.smoke:  # the tiny shape's 4:1 leaves one KV head, where every head keeps the same
        arch["num_key_value_heads"] = 2
    model = build_model(arch, mode, "sdpa", sharpen=True)
    runner = Runner(model, mlp_chunk=mode.mlp_chunk)
    length = mode.head_adaptive_length
    ids = tokens(1, length, arch["vocab_size"], mode.device, seed=3)
    settings = {"snapkv": mode.scaled(snapkv.SnapKV(budget=1024, window=32, kernel=7)),
                "adakv": mode.scaled(snapkv.AdaKV(budget=1024, window=32, kernel=7))}
    rows = {}
    for name, cfg in settings.items():
        timing = decode_latency(runner, ids, cfg, mode)
        with PeakMeter(mode.device) as meter:
            gen = runner.generate(ids, cfg, mode.decode_tokens)
        rows[name] = {**timing, "kv_cache_bytes": gen.kv_cache_bytes, "peak_above_model_bytes": meter.above_base,
                      **gen.storage_bytes}
    snap, ada = rows["snapkv"], rows["adakv"]
    return {"model": f"random, {arch['num_attention_heads']} query / {arch['num_key_value_heads']} KV heads, "
                     f"{arch['num_hidden_layers']} layers, "
                     f"{str(mode.dtype).removeprefix('torch.')}, sdpa",
            "input_tokens": length, "budget": settings["adakv"].budget, "rows": rows,
            "kv_bytes_ratio": round(ada["kv_cache_bytes"] / snap["kv_cache_bytes"], 4),
            "padded_kv_bytes_ratio": round(ada["padded_kv_bytes"] / snap["kv_cache_bytes"], 4),
            "masked_kv_bytes_ratio": round(ada["masked_kv_bytes"] / snap["kv_cache_bytes"], 4),
            "decode_ratio": round(ada["decode_ms_per_token"] / snap["decode_ms_per_token"], 3),
            "peak_ratio": round(ada["peak_above_model_bytes"] / max(snap["peak_above_model_bytes"], 1), 3),
            "targets": "KV bytes within 2% of SnapKV's, decoding within 15%, peak within 10%"}


def section_items(mode: Mode, clock: Clock) -> dict:
    """Items in flight (``batch.items``): a LongBench-shaped run of random prompts on the LWM-7B shape,
    eight of 2K tokens with 32-token answers and two of 8K with 512, Table 1's five settings: one at a
    time (settings one after another, and decoded together) against the planner's batches (auto)."""
    from omegaconf import OmegaConf

    from eval.batching import BatchOptions
    from eval.bench.items import measure_items
    from eval.engine import Prompt
    model = lwm_model(mode)
    runner = Runner(model, mlp_chunk=mode.mlp_chunk)
    vocab = mode.lwm["vocab_size"]
    short, long = (64, 256) if mode.smoke else (2048, 8192)
    answers = (4, 16) if mode.smoke else (32, 512)
    prompts = [Prompt(tokens(1, short + short // 20 * i, vocab, mode.device, seed=10 + i)[0].tolist(), answers[0], [])
               for i in range(8)]
    prompts += [Prompt(tokens(1, long - long // 27 * i, vocab, mode.device, seed=20 + i)[0].tolist(), answers[1], [])
                for i in range(2)]
    settings = [mode.scaled(cfg) for cfg in TABLE1]
    model_cfg = OmegaConf.create({"architecture": mode.lwm, "dtype": str(mode.dtype).removeprefix("torch."),
                                  "attn_implementation": _LWM_MODELS["attn"], "mlp_chunk": mode.mlp_chunk})
    result = measure_items(runner, prompts, settings, BatchOptions(items="auto"), model_cfg)
    return {"model": f"random LWM-7B shape, {model_cfg.dtype}, {_LWM_MODELS['attn']}",
            **{k: result[k] for k in ("items", "batch_sizes", "one_at_a_time_items_per_s", "together_items_per_s",
                                      "in_flight_items_per_s", "speedup", "speedup_over_together", "answers",
                                      "answers_equal", "token_agreement")}}


def section_long_generation(mode: Mode, clock: Clock) -> dict:
    """Compression while decoding (docs/decoding.md): a 64-token prompt and 4,096 tokens written on the LWM-7B
    shape, full KV against cuts to 512 tokens every 128 (Knorm, StreamingLLM, TOVA, AdaKV): ms/token over the first and
    the last 512 tokens, KV at the end, the peak above the weights and the planner's error."""
    from types import SimpleNamespace

    from eval.bench.long_generation import measure_long_generation
    model = lwm_model(mode)
    node = SimpleNamespace(prompt_tokens=64, decode_tokens=256 if mode.smoke else 4096, span=64 if mode.smoke else 512,
                           methods=["knorm", "streamingllm", "tova", "adakv"], target=96 if mode.smoke else 512,
                           interval=72 if mode.smoke else 128, buffer=72 if mode.smoke else 256)
    result = measure_long_generation(model, node, str(mode.dtype).removeprefix("torch."))
    return {"model": f"random LWM-7B shape, {mode.dtype}", **result}


def section_speculative(mode: Mode, clock: Clock) -> dict:
    """The SnapKV paper's section 5 (docs/decoding.md): greedy against prompt-lookup decoding and assisted generation
    (a 2-layer random draft of the same vocabulary) on the LWM-7B shape, full KV against SnapKV 1024, on prompts that
    repeat a random block (so the lookup finds drafts): forward passes, tokens/s, each equal to greedy. On a GPU a
    verification pass costs about what one token does, so fewer passes are a real speed-up."""
    from types import SimpleNamespace

    from eval.bench.speculative import measure_speculative
    model = lwm_model(mode)
    vocab = mode.lwm["vocab_size"]
    draft = build_model({**mode.lwm, "num_hidden_layers": 2}, mode, _LWM_MODELS["attn"])
    lengths = [256, 1024] if mode.smoke else [4096, 16384]
    by_length = {}
    for length in lengths:
        block = tokens(1, 512 if not mode.smoke else 64, vocab, mode.device, seed=31)
        by_length[length] = block.repeat(1, length // block.shape[1] + 1)[:, :length]
    node = SimpleNamespace(decode_tokens=16 if mode.smoke else 128, lookup_tokens=10, methods=["snapkv"],
                           budget=mode.scaled(snapkv.SnapKV(budget=1024)).budget)
    result = measure_speculative(model, by_length, node, draft)
    return {"model": f"random LWM-7B shape, {mode.dtype}; draft: its first 2 layers' shape", **result}


def section_prefill_limit(mode: Mode, clock: Clock) -> dict:
    """The longest prompt this device holds with the chunked prefill (``snapkv.prefill``): LWM-7B's shape, SnapKV
    1024 (window 16, kernel 5), planned on the device's memory, then prefilled at doubling lengths as long as the
    time left allows (a fit of time ~ a*L + b*L^2 on the runs so far), each peak measured (``max_memory_allocated``)
    beside the plan; the bytes per prompt token over the last two runs, measured and planned."""
    model = lwm_model(mode)
    attn = _LWM_MODELS["attn"]
    dtype = str(mode.dtype).removeprefix("torch.")
    cfg = mode.scaled(snapkv.SnapKV(budget=1024, window=16, kernel=5, pooling="maxpool"))
    memory_bytes = torch.cuda.get_device_properties(0).total_memory if mode.device == "cuda" else mode.cap_bytes
    kw = dict(dtype=dtype, attn_implementation=attn, device=mode.device, decode_tokens=1)
    longest = memory.longest_fitting(mode.lwm, memory_bytes, cfg, limit=2**23, **kw)
    if mode.smoke:
        longest = min(longest, 4096)
    out = {"setting": cfg.label(), "attention": attn, "memory_gib": round(memory_bytes / GIB, 1),
           "planned_longest": longest, "prefill_chunk": snapkv.prefill.PREFILL_CHUNK, "runs": []}
    runner = Runner(model)
    length, times = int(32768 / 32 if mode.smoke else 32768), {}
    while length <= longest:
        if len(times) >= 2:
            predicted = predicted_prefill_s(times, length)
            if predicted > clock.left() - 10:
                out["runs"].append({"input_tokens": length, "skipped": f"predicted {predicted:.0f} s, "
                                                                       f"{clock.left():.0f} s left"})
                break
        ids = tokens(1, length, mode.lwm["vocab_size"], mode.device)
        planned = memory.plan(mode.lwm, length, cfg, **kw)["peak_above_weights_bytes"]
        try:
            with PeakMeter(mode.device) as meter:
                gen = runner.generate(ids, cfg, 1)
        except Exception as exc:
            if not is_oom(exc):
                raise
            out["runs"].append({"input_tokens": length, "oom": True, "planned_gib": round(planned / GIB, 2)})
            break
        finally:
            del ids
            free_memory()
        times[length] = gen.prefill_s
        out["runs"].append({"input_tokens": length, "prefill_s": round(gen.prefill_s, 2),
                            "measured_gib": round(meter.above_base / GIB, 3), "planned_gib": round(planned / GIB, 3),
                            "planner_error": round(planned / meter.above_base - 1, 4) if meter.above_base > 0
                            else None})
        length = min(2 * length, longest) if length < longest else longest + 1
    done = [r for r in out["runs"] if "measured_gib" in r]
    if len(done) >= 2:
        (a, b) = done[-2:]
        span = b["input_tokens"] - a["input_tokens"]
        measured = (b["measured_gib"] - a["measured_gib"]) * GIB / span
        planned = (b["planned_gib"] - a["planned_gib"]) * GIB / span
        out["bytes_per_token"] = {"measured": round(measured), "planned": round(planned),
                                  "planner_error": round(planned / measured - 1, 4) if measured > 0 else None}
    out["longest_run"] = done[-1]["input_tokens"] if done else None
    out["paper"] = "380K tokens on one A100-80GB (the one-pass Hugging Face prefill)"
    return out


SECTIONS = {"environment": section_environment, "exactness": section_exactness, "speed": section_speed,
            "memory": section_memory, "long_context": section_long_context, "shared_prefill": section_shared_prefill,
            "head_adaptive": section_head_adaptive, "items": section_items,
            "long_generation": section_long_generation, "prefill_limit": section_prefill_limit,
            "speculative": section_speculative}


# -- report ------------------------------------------------------------------------------------

def markdown(report: dict) -> str:
    lines = [f"# GPU check ({report['mode']})", "",
             f"Command: `{report['command']}`; started {report['started']}.", ""]
    for name, result in report["sections"].items():
        lines += [f"## {name} ({result['status']}, {result['seconds']} s of {result['budget_s']} s)", ""]
        if result["status"] != "ok":
            lines += ["```", result.get("error", ""), "```", ""]
        body = {k: v for k, v in result.get("result", {}).items()}
        lines += ["```json", json.dumps(body, indent=1, default=str), "```", ""]
    return "\n".join(lines)


def write(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(report))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="every section on CPU with tiny shapes")
    parser.add_argument("--out", default=str(ROOT / "results" / "gpu_check"))
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    args = parser.parse_args(argv)
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown:
        print(f"error: --sections: {unknown[0]!r} is not a section; choose from {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    mode = Mode(args.smoke)
    if not args.smoke and mode.device != "cuda":
        print("error: no CUDA device: the full mode needs a GPU (--smoke runs every section on CPU)", file=sys.stderr)
        return 2
    out = Path(args.out)
    report = {"mode": "smoke (CPU, tiny shapes)" if args.smoke else "full",
              "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": " ".join(["python scripts/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
              "sections": {}}
    for name in wanted:
        budget = mode.budgets[name]
        clock = Clock(budget)
        print(f"[gpu_check] {name} (budget {budget:.0f} s) ...", flush=True)
        entry = {"budget_s": budget}
        try:
            with hard_limit(budget * 1.5 + 10):
                entry["result"] = SECTIONS[name](mode, clock)
            entry["status"] = "ok"
        except Exception as exc:
            entry.update(status="failed", error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}")
        free_memory()
        entry["seconds"] = round(budget - clock.left(), 1)
        report["sections"][name] = entry
        print(f"[gpu_check] {name}: {entry['status']} in {entry['seconds']} s", flush=True)
        print(json.dumps(entry.get("result", entry.get("error")), default=str)[:3000], flush=True)
        write(report, out)
    failed = [n for n, e in report["sections"].items() if e["status"] != "ok"]
    print(f"[gpu_check] report: {out / 'gpu_check.md'}; {len(wanted) - len(failed)} sections ok, "
          f"{len(failed)} failed{': ' + ', '.join(failed) if failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
