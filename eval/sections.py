"""The typed shape of every config section: the model and each task (Hydra structured configs).

Each section is a dataclass registered in Hydra's ConfigStore as ``schema/<section>`` and put under
its section by the task's defaults list (``- schema/longbench@longbench``), so Hydra checks types as
it composes: ``longbench.limit=abc`` stops with an error naming ``longbench.limit`` and the type it
needs. The allowed values of a field with a fixed set of choices are declared here too
(``one_of``) and checked by ``check_sections`` when a job starts, one line naming the field and the
choices. The YAML files under ``conf/`` hold the defaults a user reads; a key added with ``+`` still
composes (and enters the settings fingerprint).

Fields typed ``Any`` take more than one shape on purpose: text typed on the command line as a number
(``needle.answer=58213``, read back as typed, see ``eval.hydra_app.typed_text``), lists given as a
range or a list, paths that may be interpolations.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from snapkv.errors import check_choice


def _paper_datasets():
    from .longbench.data import PAPER_DATASETS
    return PAPER_DATASETS


def _ruler_tasks():
    from .ruler.templates import TASKS
    return TASKS


def one_of(default, choices: str, allow_null: bool = False):
    """A field whose value must be one of ``module:NAME`` (read when a job starts)."""
    return field(default=default, metadata={"choices": choices, "allow_null": allow_null})


@dataclass
class ModelSection:
    name: str = MISSING
    path: Optional[str] = None            # hub id or local folder
    revision: Optional[str] = None        # hub revision of the weights (a commit, tag or branch)
    package_file: Optional[str] = None    # a file inside an installed package (the demo's GGUF)
    tokenizer: Optional[str] = None
    random_init: bool = False             # random weights from ``architecture`` (tests, speed figures)
    architecture: Optional[Dict[str, Any]] = None
    dtype: str = one_of("float32", "eval.runner:DTYPES")
    attn_implementation: str = one_of("sdpa", "eval.runner:ATTENTION")
    max_length: Optional[int] = None
    trained_context: Optional[int] = None
    chat_format: str = one_of("none", "eval.chat:CHAT_FORMATS")
    protocol: str = one_of("longbench", "eval.longbench.prompt:PROTOCOLS")
    use_fast_tokenizer: bool = True
    device_map: Any = None
    mlp_chunk: Optional[int] = None
    prefill_chunk: Optional[int] = 2048   # a compressing prefill's chunk (snapkv.prefill); null: the model's one pass


@dataclass
class LongBenchSection:
    datasets: List[str] = field(default_factory=lambda: list(_paper_datasets()))
    data_dir: Optional[str] = None
    limit: Optional[int] = None
    max_new_tokens: Optional[int] = None
    revision: str = "main"
    retry_oom: bool = False


@dataclass
class LongBenchV2Section:
    data_file: Optional[str] = None
    revision: str = "main"
    limit: Any = None
    cot: bool = False
    max_length: Optional[int] = 120000
    max_new_tokens: Optional[int] = None
    cot_max_new_tokens: Optional[int] = None
    retry_oom: bool = False


@dataclass
class NeedleSection:
    haystack: Any = "noise"
    needle: Any = MISSING
    question: Any = MISSING
    answer: Any = MISSING
    extra_needles: List[Any] = field(default_factory=list)
    prompt: str = one_of("plain", "eval.needle.build:PROMPTS")
    chat_format: Optional[str] = one_of(None, "eval.chat:CHAT_FORMATS", allow_null=True)
    scorer: str = one_of("recall", "eval.needle.score:SCORERS")
    max_new_tokens: Any = 32
    stop_at_newline: bool = False
    lengths: Any = None
    grid: str = one_of("linear", "eval.needle.grid:GRIDS")
    min_length: int = 1000
    max_length: int = 4000
    num_lengths: int = 4
    depths: Any = None
    num_depths: Optional[int] = None
    skip_after_oom: bool = True
    retry_oom: bool = False
    retry_failed: bool = False
    full_kv_frontier: Optional[int] = None
    dry_run: bool = False
    memory_gib: Optional[float] = None


@dataclass
class LinesSection:
    seed: int = 0
    pool: int = 4000
    lengths: Any = field(default_factory=lambda: [1000, 2000])
    grid: str = one_of("linear", "eval.needle.grid:GRIDS")
    min_length: int = 1000
    max_length: int = 4000
    num_lengths: int = 4
    depths: Any = field(default_factory=lambda: [0, 25, 50, 75, 100])
    num_depths: Optional[int] = None
    chat_format: Optional[str] = one_of(None, "eval.chat:CHAT_FORMATS", allow_null=True)
    max_new_tokens: int = 32
    skip_after_oom: bool = True
    retry_oom: bool = False
    retry_failed: bool = False


@dataclass
class RulerSection:
    tasks: List[str] = field(default_factory=lambda: list(_ruler_tasks()))
    lengths: List[int] = field(default_factory=lambda: [4096, 8192, 16384, 32768, 65536, 131072])
    samples: int = 500
    seed: int = 42
    template: Optional[str] = one_of(None, "eval.ruler.templates:MODEL_TEMPLATES", allow_null=True)
    essays: Optional[str] = None
    punkt: Optional[str] = None
    squad: Optional[str] = None
    hotpotqa: Optional[str] = None
    export: Optional[str] = None
    retry_oom: bool = False
    source: str = one_of("generate", "eval.ruler.predict:SOURCES")
    kvpress_data: Optional[str] = None


@dataclass
class MathSection:
    dataset: str = one_of("aime25", "eval.math.data:DATASETS")
    data: Optional[str] = None
    revision: str = "main"
    limit: Optional[int] = None
    max_new_tokens: Optional[int] = None
    chat_format: Optional[str] = one_of(None, "eval.chat:CHAT_FORMATS", allow_null=True)
    enable_thinking: bool = False
    retry_oom: bool = False


@dataclass
class ObserveSection:
    data: str = MISSING
    response: str = one_of("reference", "eval.observe:RESPONSES")
    window: int = 128
    prompt_windows: int = 20
    response_windows: int = 4
    p: float = 0.1
    theta: float = 0.01
    pooling: str = one_of("none", "snapkv.method:POOLINGS")
    kernel: int = 1
    question_position: str = one_of("end", "eval.observe.data:QUESTION_POSITIONS")
    variant: str = one_of("hits", "eval.observe:VARIANTS")
    other_instructions: int = 2
    min_prompt_tokens: int = 3000
    min_response_tokens: int = 512
    limit: Optional[int] = None


@dataclass
class BenchSweepSection:
    enabled: bool = False
    settings: Any = "table1"
    budget_scale: float = 1.0
    dataset: str = "multi_news"
    data_dir: Optional[str] = "eval/data/longbench_sample"
    rows: int = 2
    max_new_tokens: Optional[int] = None
    decode_together: bool = True


@dataclass
class BenchBatchingSection:
    enabled: bool = False
    batch: Any = "auto"                 # N or auto (eval.batching)
    prefill: str = "each"               # each | padded (eval.batching)
    memory_gib: Optional[float] = None  # auto's memory (null: the GPU's free memory, or the available RAM)
    max_items: int = 16
    settings: Any = "table1"
    budget_scale: float = 0.25
    short: int = 8
    long: int = 2
    data_dir: Optional[str] = "eval/data/longbench_sample"


@dataclass
class BenchLongGenerationSection:
    enabled: bool = False
    prompt_tokens: int = 64
    decode_tokens: int = 4096
    span: int = 512
    methods: List[str] = field(default_factory=lambda: ["knorm", "streamingllm", "tova", "adakv"])
    target: int = 512
    interval: int = 128
    buffer: int = 256


@dataclass
class BenchPrefillMemorySection:
    enabled: bool = False
    lengths: List[int] = field(default_factory=lambda: [4096, 8192])  # the slope's two lengths
    methods: List[str] = field(default_factory=lambda: ["snapkv"])
    budget: int = 1024
    measure_memory: bool = True          # false: the timings and plans alone
    time_lengths: List[int] = field(default_factory=lambda: [8192])  # [] : no timing
    repeats: int = 1                     # timing repeats (medians), chunked and one pass alternating
    plan_model: Optional[str] = "lwm-1m"  # a conf/model file whose architecture is planned; null: none
    plan_lengths: List[int] = field(default_factory=lambda: [380000, 1048576, 2097152])
    memory_gib: List[int] = field(default_factory=lambda: [24, 48, 80, 141])


@dataclass
class BenchSpeculativeSection:
    enabled: bool = False
    lengths: List[int] = field(default_factory=lambda: [512, 1536])
    methods: List[str] = field(default_factory=lambda: ["snapkv"])
    budget: int = 256
    decode_tokens: int = 64
    lookup_tokens: int = 10
    draft_model: Optional[str] = None
    item: int = 0
    data_dir: str = "eval/data/longbench_sample"


@dataclass
class BenchSection:
    lengths: List[int] = field(default_factory=lambda: [1024, 4096])
    budgets: List[int] = field(default_factory=lambda: [1024])
    methods: List[str] = field(default_factory=lambda: ["full", "snapkv"])
    batch_sizes: List[int] = field(default_factory=lambda: [1])
    decode_tokens: int = 16
    question_tokens: int = 32
    repeats: int = 3
    prefill_repeats: Optional[int] = None
    fresh_process: Any = "auto"
    plan: bool = False
    measure: bool = True
    memory_gib: float = 80
    frontier: bool = False
    frontier_min: int = 1024
    frontier_start: str = one_of("planner", "eval.bench.frontier:FRONTIER_STARTS")
    frontier_max: int = 1048576
    frontier_resolution: float = 0.02
    probe_timeout_s: float = 3600
    plan_lengths: List[int] = field(default_factory=lambda: [16384, 33000, 131072, 380000])
    sweep: BenchSweepSection = field(default_factory=BenchSweepSection)
    batching: BenchBatchingSection = field(default_factory=BenchBatchingSection)
    long_generation: BenchLongGenerationSection = field(default_factory=BenchLongGenerationSection)
    prefill_memory: BenchPrefillMemorySection = field(default_factory=BenchPrefillMemorySection)
    speculative: BenchSpeculativeSection = field(default_factory=BenchSpeculativeSection)


@dataclass
class ReportSection:
    runs: str = "results/runs"
    out: str = "results/report"
    label: Optional[str] = None


SECTIONS = {"model": ModelSection, "longbench": LongBenchSection, "longbench_v2": LongBenchV2Section,
            "needle": NeedleSection, "lines": LinesSection, "ruler": RulerSection, "math": MathSection,
            "observe": ObserveSection, "bench": BenchSection, "report": ReportSection}


def _choices(ref: str):
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def check_sections(cfg) -> None:
    """Every field with a fixed set of choices in the model's and the task's sections holds one of them
    (an experiment preset may set other tasks' sections too; they are checked by their own task)."""
    for section in ("model", cfg.get("task")):
        node = cfg.get(section) if section in SECTIONS else None
        if node is not None:
            _check(node, SECTIONS[section], section)


def _check(node, schema, prefix: str) -> None:
    for f in fields(schema):
        value = node.get(f.name)
        if "choices" in f.metadata and not (value is None and f.metadata["allow_null"]):
            check_choice(f"{prefix}.{f.name}", value, tuple(_choices(f.metadata["choices"])))
        if is_dataclass(f.default_factory) and value is not None:  # a nested section
            _check(value, f.default_factory, f"{prefix}.{f.name}")


def register_schemas() -> None:
    store = ConfigStore.instance()
    for section, schema in SECTIONS.items():
        store.store(group="schema", name=section, node=schema, provider="snapkv")


register_schemas()
