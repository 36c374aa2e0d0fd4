"""DuoAttention (Xiao et al., arXiv 2410.10819, "DuoAttention: Efficient Long-Context LLM Inference with Retrieval
and Streaming Heads"), as kvpress 0.5.5 ``DuoAttentionPress`` applies it, from local data.

Every (layer, KV head) has a score; the ``head_ratio`` share of them with the lowest scores (kvpress's
``head_compression_ratio``: ``round(layers x kv_heads x head_ratio)`` pairs, ranked by ``np.argsort`` over the
whole table as kvpress ranks them) become streaming heads, which keep only the prompt's first ``sink_size`` and
last ``recent_size`` tokens; the others (retrieval heads) keep every token. kvpress masks the streaming heads'
other keys and keeps them in memory; here each head stores only what it keeps (``select`` returns ``valid``: a
ragged layer), so the streaming heads' slots are freed.

The scores come from one of two local sources, read once per model (``Method.prepare``, when ``snapkv.compress``
starts: kvpress's ``post_init_from_model``) and cached per model and data, not per prompt:

- ``patterns``: a DuoAttention pattern folder, as the DuoAttention repo's ``attn_patterns/<model>/<run>/`` holds
  them: ``config.json`` (its ``sink_size`` and ``recent_size``) and ``full_attention_heads.tsv`` (one row a layer,
  one tab-separated column a KV head), the scores clipped to [0, 1] as ``duo_attn.utils.load_attn_pattern`` does.
  kvpress downloads that folder from GitHub for six checkpoints; here it is a path (kvpress's ``duo_attention``
  entry).
- ``on_the_fly_scoring=true``: kvpress's ``duo_attention_on_the_fly``, computed from ``on_the_fly_text`` (a text
  file, a folder of ``.txt`` files or a JSONL file of texts) in place of the 50 BookSum chapters kvpress downloads
  (the hub's ``kmfoda/booksum``); sink 128 and recent 256 as kvpress fixes them. 50 texts are drawn as pandas'
  ``sample(50, random_state=42)`` draws rows (all of them, in that generator's order, when there are fewer); per
  text and layer the mean pre-RoPE query and key over the text's tokens are repeated 500 times, rotated at positions
  0..499, and the last query's attention over the 500 keys gives each query head the mean of its cumulated
  attention (the "area under the cumulated attention curve"), averaged over each KV group and summed over the texts
  (each divided by their count), line for line as kvpress computes it. It needs the model's tokenizer (the one
  given to ``snapkv.compress``, else the model folder's, as kvpress loads it).

No token budget applies: ``budget`` and ``ratio`` are derived (kvpress's ``evaluate.py`` sets
``head_compression_ratio`` for this press and drops its ``compression_ratio``, which the press computes:
``streaming share x (1 - (sink + recent) / n)``). Each layer records its mean kept tokens per KV head.
"""
from __future__ import annotations

import json
import os
import weakref
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

from ..architectures import attention_of, layer_rotary, module_call, reading, rotated
from ..errors import InputError, check_bool, check_choice, check_int, check_number
from ..method import GQA_MODES, Method
from ..registry import register
from ..select import pack

ON_THE_FLY_SIZES = (128, 256)  # kvpress's sink and recent sizes for scores computed on the fly
SAMPLES, QUERY_LENGTH, SEED = 50, 500, 42  # duo_attention_on_the_fly's num_samples, q_len; pandas' random_state
TEXT_FIELDS = ("chapter", "text", "context")  # a JSONL row's text: BookSum's column, or a plain one
PATTERN_FILES = ("config.json", "full_attention_heads.tsv")

_PATTERNS: dict = {}                                 # (folder, mtimes) -> (sink, recent, scores)
_ON_THE_FLY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {texts' key: scores}


def load_pattern(folder: str) -> tuple[int, int, np.ndarray]:
    """``(sink_size, recent_size, scores [layers, kv_heads])`` of a DuoAttention pattern folder, the scores clipped
    to [0, 1] (kvpress's ``load_attention_pattern``, from a local folder); cached while its files are unchanged."""
    path = Path(folder).expanduser()
    what = (f"patterns={folder!r}: a DuoAttention pattern folder holds {' and '.join(PATTERN_FILES)} (as the "
            "DuoAttention repo's attn_patterns/<model>/<run>/)")
    if not path.is_dir():
        raise InputError(f"{what}; this is not a folder")
    files = [path / name for name in PATTERN_FILES]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise InputError(f"{what}; {' and '.join(missing)} is missing")
    key = (str(path.resolve()), *(f.stat().st_mtime_ns for f in files))
    if key not in _PATTERNS:
        try:
            config = json.loads(files[0].read_text(encoding="utf-8"))
            sink, recent = config["sink_size"], config["recent_size"]
        except (OSError, ValueError, TypeError, KeyError) as error:
            raise InputError(f"patterns={folder!r}: config.json gives no sink_size and recent_size "
                             f"({type(error).__name__}: {error})") from None
        for name, value, least in (("sink_size", sink, 0), ("recent_size", recent, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InputError(f"patterns={folder!r}: config.json's {name}={value!r} must be an integer >= {least}")
        try:
            scores = np.loadtxt(files[1], dtype=float, delimiter="\t", ndmin=2)
        except (OSError, ValueError) as error:
            raise InputError(f"patterns={folder!r}: full_attention_heads.tsv is unreadable as tab-separated numbers "
                             f"({str(error).splitlines()[0] if str(error) else type(error).__name__})") from None
        if scores.size == 0 or not np.isfinite(scores).all():
            raise InputError(f"patterns={folder!r}: full_attention_heads.tsv holds no scores, or scores that are not "
                             "finite")
        _PATTERNS[key] = (sink, recent, np.clip(scores, 0, 1))
    return _PATTERNS[key]


def read_texts(source: str) -> tuple[list[str], tuple]:
    """The texts of ``on_the_fly_text`` and a key naming them (path, sizes, modification times): a folder's ``.txt``
    files (by name), a JSONL file's rows (each row's first of ``TEXT_FIELDS``), or one text file."""
    path = Path(source).expanduser()
    what = (f"on_the_fly_text={source!r}: give a local text file, a folder of .txt files or a JSONL file of texts "
            "(in place of kvpress's BookSum chapters)")
    if not path.exists():
        raise InputError(f"{what}; it does not exist")
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    if not files:
        raise InputError(f"{what}; the folder has no .txt file")
    texts = []
    try:
        for file in files:
            text = file.read_text(encoding="utf-8")
            if file.suffix != ".jsonl":
                texts.append(text)
                continue
            for number, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                found = [row[name] for name in TEXT_FIELDS if isinstance(row, dict) and isinstance(row.get(name), str)]
                if not found:
                    raise InputError(f"on_the_fly_text={source!r}: line {number} has no text (a JSON object with one "
                                     f"of {', '.join(TEXT_FIELDS)})")
                texts.append(found[0])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InputError(f"on_the_fly_text={source!r} is unreadable ({type(error).__name__}: {error})") from None
    texts = [text for text in texts if text.strip()]
    if not texts:
        raise InputError(f"{what}; it holds no text")
    key = (str(path.resolve()), *((f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    return texts, key


def sampled(texts: list[str]) -> list[str]:
    """kvpress's ``dataset.sample(50, random_state=42)``: pandas draws ``RandomState(42).choice(n, 50,
    replace=False)``, the first 50 of ``RandomState(42).permutation(n)`` (all ``n`` in that order when fewer)."""
    order = np.random.RandomState(SEED).permutation(len(texts))[:SAMPLES]
    return [texts[i] for i in order]


def on_the_fly_scores(replay, texts: list[str]) -> np.ndarray:
    """``[layers, kv_heads]``: kvpress's ``duo_attention_on_the_fly`` over ``texts`` (already sampled), in float32."""
    model, layers = replay.model, replay.layers
    tokenizer = replay.tokenizer
    if tokenizer is None:
        raise InputError("on_the_fly_scoring=true needs the model's tokenizer for its texts: pass "
                         "snapkv.compress(model, cfg, tokenizer=...) (none in model.config.name_or_path="
                         f"{getattr(model.config, 'name_or_path', '')!r})")
    config = model.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    groups = config.num_attention_heads // kv_heads
    rotary = replay.decoder.rotary_emb
    device = next(model.parameters()).device
    position_ids = torch.arange(QUERY_LENGTH).unsqueeze(0)
    scores = torch.zeros((len(layers), kv_heads))
    with torch.no_grad():
        for text in texts:
            inputs = tokenizer(text, return_tensors="pt").to(device)
            hidden_states = list(model(**inputs, output_hidden_states=True, use_cache=False).hidden_states[:-1])
            for layer_idx, h in enumerate(hidden_states):
                module = layers[layer_idx]
                attn = attention_of(module)
                d = reading(attn).head_dim
                h = module.input_layernorm(h)
                # the module's own queries and keys before RoPE (its norms included), positions first
                pre = module_call(attn, h)
                q, k = pre.query.transpose(1, 2), pre.key.transpose(1, 2)
                q = q.mean(dim=1, keepdim=True).repeat(1, QUERY_LENGTH, 1, 1).transpose(1, 2)
                k = k.mean(dim=1, keepdim=True).repeat(1, QUERY_LENGTH, 1, 1).transpose(1, 2)
                cos, sin = layer_rotary(rotary, attn, h, position_ids.to(h.device))
                q, k = rotated(attn, q, cos, sin), rotated(attn, k, cos, sin)
                k = k.repeat_interleave(groups, dim=1)
                weights = torch.matmul(q[:, :, -1:, :], k.transpose(2, 3)) / (d ** 0.5)
                weights = weights.softmax(dim=-1, dtype=torch.float32).reshape(-1, QUERY_LENGTH)
                s = torch.cumsum(weights, dim=1).mean(1)   # the area under the cumulated attention curve
                s = s.view(-1, groups).mean(1)
                scores[layer_idx] += s.cpu() / len(texts)
    return scores.numpy()


def streaming_heads(scores: np.ndarray, head_ratio: float) -> torch.Tensor:
    """``[layers, kv_heads]`` bool: the ``round(size x head_ratio)`` lowest scores (kvpress's ``np.argsort`` over
    the flattened table; ties in numpy's order, as in kvpress)."""
    mask = torch.zeros(scores.shape, dtype=torch.bool)
    n_pruned = round(scores.size * head_ratio)
    if n_pruned > 0:
        indices = np.argsort(scores, axis=None)[:n_pruned]
        mask[np.unravel_index(indices, scores.shape)] = True
    return mask


@register
@dataclass
class DuoAttention(Method):
    method = "duo_attention"
    display_name = "DuoAttention"
    kvpress_entries = {
        "duo_attention": {
            "placements": (),  # a local pattern folder per model; its size is head_ratio, not the board's ratio
            "parity": "kept positions and tokens equal (tested, from pattern folders written for the two models: "
                      "kvpress downloads the authors' for six checkpoints)"},
        "duo_attention_on_the_fly": {
            "on_the_fly_scoring": True, "option": "duo_attention_on_the_fly", "placements": (),
            "parity": "head scores, kept positions and tokens equal on SmolLM2 (tested, local texts in place of "
                      "BookSum; the tiny model's head scores with a stand-in tokenizer)"}}
    paper = "DuoAttention, arXiv 2410.10819"
    reference = ("kvpress 0.5.5 `DuoAttentionPress`: the `head_compression_ratio` lowest-scored (layer, KV head) pairs "
                 "are streaming heads keeping `sink_size` first and `recent_size` last tokens, the others everything; "
                 "scores from a DuoAttention pattern folder, or `duo_attention_on_the_fly` (sink 128, recent 256)")
    budget_meaning = ("no token budget (`budget`/`ratio` do not apply): `head_ratio` (kvpress's "
                      "`head_compression_ratio`) of the heads keep sinks + recent tokens, the others every token; a "
                      "layer records its mean per KV head")
    deviations = ("local data only: `patterns` is a local pattern folder (kvpress downloads the authors' for six "
                  "checkpoints), `on_the_fly_text` local texts in place of BookSum; the streaming heads' other "
                  "slots are freed, not masked")
    derived = ("budget", "ratio", "window")  # no token budget, no window: the kept tokens follow from the heads
    untagged = ("gqa", "patterns", "on_the_fly_text")  # a path is in the run's fingerprint, not its folder name
    tag_parts = ("hr{head_ratio}", "fly{on_the_fly_scoring}", "s{sink_size}", "r{recent_size}")
    head_adaptive = True
    pads_batches = False           # each layer its own mean: per-layer budgets refuse padding
    scores_while_decoding = False  # the heads are chosen once per model, the cut once per prompt
    needs_local_data = True
    board_size = "head_ratio"      # kvpress's evaluate.py gives this press the board's ratio as its head ratio
    budget: int | None = None
    ratio: float | None = 0.0
    window: int = 0
    head_ratio: float = 0.5
    on_the_fly_scoring: bool = False
    patterns: str | None = None         # a DuoAttention pattern folder (config.json, full_attention_heads.tsv)
    on_the_fly_text: str | None = None  # texts scored on the fly (on_the_fly_scoring=true)
    sink_size: int | None = None        # None: the pattern's config.json, or 128 on the fly
    recent_size: int | None = None      # None: the pattern's config.json, or 256 on the fly

    def validate(self) -> None:
        # no token budget: like kvpress's evaluate.py for this press, a run's budget or ratio does not apply
        self.budget, self.ratio, self.window = None, 0.0, 0
        self.head_ratio = check_number("head_ratio", self.head_ratio, 0, 1,
                                       "the share of (layer, KV head) pairs made streaming heads")
        check_bool("on_the_fly_scoring", self.on_the_fly_scoring)
        check_choice("gqa", self.gqa, GQA_MODES)
        for name in ("patterns", "on_the_fly_text"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise InputError(f"{name}={value!r} must be a path")
            setattr(self, name, None if value is None else os.fspath(value))
        if self.on_the_fly_scoring and self.patterns is not None:
            raise InputError(f"patterns={self.patterns!r}: with on_the_fly_scoring=true the head scores come from "
                             "on_the_fly_text; leave patterns unset")
        if not self.on_the_fly_scoring and self.on_the_fly_text is not None:
            raise InputError(f"on_the_fly_text={self.on_the_fly_text!r} is read with on_the_fly_scoring=true only "
                             "(compressor=duo_attention_on_the_fly); otherwise give patterns")
        for name, least in (("sink_size", 0), ("recent_size", 1)):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), least)
        self._streaming: torch.Tensor | None = None  # [layers, kv_heads] once prepared for a model
        self._sizes: tuple[int, int] | None = None

    # -- the heads, once per model ---------------------------------------------------------------------------
    def source_sizes(self) -> tuple[int, int]:
        """``(sink, recent)`` before the overrides: the pattern's config.json, or kvpress's 128 / 256 on the fly
        (and where no pattern folder is named yet, for the planner)."""
        if not self.on_the_fly_scoring and self.patterns is not None:
            return load_pattern(self.patterns)[:2]
        return ON_THE_FLY_SIZES

    def sizes(self) -> tuple[int, int]:
        """``(sink_size, recent_size)`` each streaming head keeps."""
        if self._sizes is None:
            sink, recent = self.source_sizes()
            self._sizes = (sink if self.sink_size is None else self.sink_size,
                           recent if self.recent_size is None else self.recent_size)
        return self._sizes

    def head_scores(self, replay) -> np.ndarray:
        """``[layers, kv_heads]``: the pattern's scores, or those computed on the fly (once per model and texts)."""
        if self.on_the_fly_scoring:
            if self.on_the_fly_text is None:
                raise InputError("on_the_fly_text=None: on_the_fly_scoring=true scores the heads on local texts; "
                                 "give a text file, a folder of .txt files or a JSONL file of texts")
            texts, key = read_texts(self.on_the_fly_text)
            tokenizer = replay.tokenizer
            parameter = next(replay.model.parameters())
            key = (key, getattr(tokenizer, "name_or_path", type(tokenizer).__name__), parameter.dtype,
                   str(parameter.device))
            per_model = _ON_THE_FLY.setdefault(replay.model, {})
            if key not in per_model:
                per_model[key] = on_the_fly_scores(replay, sampled(texts))
            return per_model[key]
        if self.patterns is None:
            raise InputError("patterns=None: duo_attention reads its head scores from a local DuoAttention pattern "
                             "folder (config.json and full_attention_heads.tsv, as the DuoAttention repo's "
                             "attn_patterns/<model>/<run>/); give it, or on_the_fly_scoring=true with on_the_fly_text")
        return load_pattern(self.patterns)[2]

    def prepare(self, replay) -> None:
        layers = len(replay.layers)
        config = replay.model.config
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self._sizes = None
        self.sizes()
        scores = self.head_scores(replay)
        if scores.shape != (layers, kv_heads):
            field = "on_the_fly_text" if self.on_the_fly_scoring else "patterns"
            raise InputError(f"{field}={getattr(self, field)!r}: {scores.shape[0]} x {scores.shape[1]} head scores, "
                             f"but the model has {layers} layers x {kv_heads} KV heads")
        self._streaming = streaming_heads(scores, self.head_ratio)

    def streaming(self, num_layers: int, kv_heads: int) -> torch.Tensor:
        """``[layers, kv_heads]`` bool, the streaming heads (``prepare`` chose them; a pattern folder is read here
        if it did not run)."""
        if self._streaming is None or tuple(self._streaming.shape) != (num_layers, kv_heads):
            if self.on_the_fly_scoring:
                raise InputError("on_the_fly_scoring=true: the heads are scored with the model when snapkv.compress "
                                 "starts; apply this setting through snapkv.compress")
            scores = self.head_scores(None)
            if scores.shape != (num_layers, kv_heads):
                raise InputError(f"patterns={self.patterns!r}: {scores.shape[0]} x {scores.shape[1]} head scores, "
                                 f"but the model has {num_layers} layers x {kv_heads} KV heads")
            self._streaming = streaming_heads(scores, self.head_ratio)
        return self._streaming

    # -- the budget stages -------------------------------------------------------------------------------------
    def takes_padded_batch(self) -> bool:
        return self.pads_batches

    def budget_for(self, length: int) -> int:
        return length  # no budget in tokens: each layer's count follows from its heads (``layer_budget``)

    def layer_share(self, layer_idx: int, num_layers: int) -> float:
        """The share of the layer's KV heads that stream: known once ``prepare`` ran, else (the planner's estimate)
        ``head_ratio`` in every layer."""
        if self._streaming is not None and self._streaming.shape[0] == num_layers:
            return float(self._streaming[layer_idx].float().mean())
        return self.head_ratio

    def prefill_rows(self, length: int, question_tokens: int | None) -> int:
        return 0  # its heads' patterns, fixed per model

    def layer_budget(self, layer_idx: int, num_layers: int, length: int) -> int:
        """The mean tokens a KV head of the layer keeps (rounded; at least one fewer than ``length`` where a head
        is cut): ``length`` where no head streams or the prompt is within ``sink + recent``."""
        sink, recent = self.sizes()
        share = self.layer_share(layer_idx, num_layers)
        if length <= sink + recent or share == 0:
            return length
        return min(length - 1, round(length - share * (length - sink - recent)))

    def recent_window(self, layer_idx: int, num_layers: int, length: int) -> int:
        sink, recent = self.sizes()
        return 0 if length <= sink + recent else recent

    def select(self, ctx, budget: int, window: int):
        """Every real position for a retrieval head; the first ``sink_size`` real positions and the last
        ``recent_size`` for a streaming head (kvpress's ``[sink_size:-recent_size]`` masked), ragged."""
        keys = ctx.keys
        b, kv_heads, length, _ = keys.shape
        streams = self.streaming(ctx.num_layers, kv_heads)[ctx.layer_idx].to(keys.device)
        sink, recent = self.sizes()
        positions = torch.arange(length, device=keys.device)[None, :]
        if ctx.pad_mask is None:
            first_real = torch.zeros(b, 1, dtype=torch.long, device=keys.device)
        else:
            first_real = (~ctx.pad_mask).sum(dim=1, keepdim=True)
        rank = positions - first_real
        real = rank >= 0
        ends = real & ((rank < sink) | (positions >= length - recent))
        keep = torch.where(streams[None, :, None], ends[:, None, :], real[:, None, :])
        return pack(keep)

    def compression_bytes(self, shape, length: int, batch: int, nbytes: int) -> int:
        """Per KV head and position: the kept mask and its uint8 copy, the sort's indices and the kept positions
        (the heads' scores are read or computed once per model, before any prefill)."""
        return batch * shape.kv_heads * length * (1 + 1 + 8 + 8)

    def label(self) -> str:
        changed = [f"{f.name} {getattr(self, f.name)}" for f in fields(self)
                   if f.name not in ("budget", "ratio", "window", "head_ratio") and getattr(self, f.name) != f.default]
        return f"{self.display_name} head_ratio {self.head_ratio:g}" + (f" ({', '.join(changed)})" if changed else "")
