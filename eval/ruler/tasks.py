"""RULER's five generators (``scripts/data/synthetic/{niah,variable_tracking,common_words_extraction,
freq_words_extraction,qa}.py`` @ e40fae1), re-implemented with the same random draws in the same order.

Each RULER script seeds the global ``random`` (and numpy's) with ``--random_seed`` and draws from
them; here each run owns a ``random.Random(seed)`` and a ``numpy.random.RandomState(seed)``, which
give the same streams. RULER's quirks are kept on purpose, since published numbers come from them;
each is marked ``QUIRK``. Token counts are RULER's ``hf`` tokenizer's ``len(tokenizer.tokenize(text))``.
"""
from __future__ import annotations

import bisect
import functools
import math
import random
import re
import string
import uuid
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from snapkv.errors import InputError

from . import sources
from .templates import BASE_TASKS

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
DOCUMENT_PROMPT = "Document {i}:\n{document}"
# niah.py: 40 insertion depths (percent) for the essay haystack
DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)]
# A retry loop that RULER would run forever (a length too short for the task) stops after this many tries.
MAX_RETRIES = 1000


@dataclass
class Run:
    """One task script's invocation (what prepare.py passes it)."""
    task: str
    args: dict
    template: str                    # model template around the task template, then the answer prefix
    count: Callable[[str], int]      # tokens of a text
    max_seq_length: int
    tokens_to_generate: int
    num_samples: int
    seed: int
    remove_newline_tab: bool = False
    essays: object = None
    punkt: object = None
    squad: object = None
    hotpotqa: object = None
    rng: random.Random = field(init=False)
    nprng: np.random.RandomState = field(init=False)

    def __post_init__(self):
        self.rng = random.Random(self.seed)                  # random.seed(args.random_seed)
        self.nprng = np.random.RandomState(self.seed)        # np.random.seed(args.random_seed)


class _TooLong(Exception):
    """RULER's ``assert length <= max_seq_length`` in the per-sample retry loops."""


# ------------------------------------------------------------------------------------------ prompts

class Prompt:
    """A RULER template split at ``{context}``: the filled text, where its query starts, its answer prefix.

    The query part starts at ``Question:`` after the context where the template has one (vt, cwe,
    fwe, qa), else at the first character after the whitespace that follows the context (niah)."""

    def __init__(self, template: str, answer_prefix: str):
        if template.count("{context}") != 1 or not template.endswith(answer_prefix):
            raise ValueError("a RULER template has one {context} and ends with its answer prefix")
        self.template, self.answer_prefix = template, answer_prefix
        self.head, tail = template.split("{context}")
        at = tail.find("Question:")
        if at < 0:
            at = len(tail) - len(tail.lstrip())
        self.gap = tail[:at]

    def fill(self, context: str, **fields) -> tuple[str, int]:
        text = self.template.format(context=context, **fields)
        query_at = len(self.head.format(**fields)) + len(context) + len(self.gap.format(**fields))
        return text, query_at

    def prefix(self, **fields) -> str:
        return self.answer_prefix.format(**fields)


def _collapse(text: str) -> str:
    """RULER's ``--remove_newline_tab``."""
    return " ".join(text.replace("\n", " ").replace("\t", " ").strip().split())


def _row(run: Run, index: int, text: str, outputs: list, length: int, query_at: int, answer_prefix: str) -> dict:
    if run.remove_newline_tab:
        before = text[:query_at].replace("\n", " ").replace("\t", " ")
        kept = _collapse(before)
        query_at = len(kept) + (1 if kept and before[-1:].isspace() else 0)
        text, answer_prefix = _collapse(text), _collapse(answer_prefix)
    return {"index": index, "input": text, "outputs": outputs, "length": length,
            "answer_prefix": answer_prefix, "query_at": query_at}


def _fitted(run: Run, make, used: int, incremental: int, extra_tokens: int = 0, limit: int | None = None):
    """RULER's per-sample loop: draw with ``used`` haystack units, measure the prompt plus the tokens to
    generate (and ``extra_tokens``); when it is longer than ``limit`` (``max_seq_length``) or the draw
    fails, shrink the haystack (not below ``incremental``) and draw again (QUIRK: RULER's bare
    ``except`` also retries errors of the draw). Returns ``(text, outputs, length, query_at, prefix)``."""
    limit = run.max_seq_length if limit is None else limit
    for _ in range(MAX_RETRIES):
        try:
            text, answer, query_at, prefix = make(used)
            length = run.count(text) + run.tokens_to_generate + extra_tokens
            if length > limit:
                raise _TooLong
            return text, answer, length, query_at, prefix
        except InputError:
            raise
        except (_TooLong, ValueError, IndexError):
            if used > incremental:
                used -= incremental
    raise InputError("ruler.length: too short for this task (RULER's generator would retry forever)")


# --------------------------------------------------------------------------------------------- niah

class AdjNounWords:
    """``sorted(set(f"{adj}-{noun}" for adj in adjs for noun in nouns))`` (niah.py's key words, 6.2M
    strings) as an indexable sequence without building it: the combinations of one adjective are
    contiguous and in noun order, except for adjectives that extend another with a hyphen ("blue",
    "blue-eyed"), whose few families are built and sorted outright."""

    def __init__(self, adjs, nouns):
        nouns = sorted(set(nouns))
        adjs = set(adjs)

        def root(adj):
            for i, ch in enumerate(adj):
                if ch == "-" and adj[:i] in adjs:
                    return adj[:i]
            return adj
        families: dict[str, list[str]] = {}
        for adj in adjs:
            families.setdefault(root(adj), []).append(adj)
        self._nouns = nouns
        self._blocks = []   # (root, explicit sorted words or None)
        starts, total = [], 0
        for r in sorted(families, key=lambda a: a + "-"):
            members = families[r]
            words = None if len(members) == 1 else sorted({f"{a}-{n}" for a in members for n in nouns})
            starts.append(total)
            total += len(nouns) if words is None else len(words)
            self._blocks.append((r, words))
        self._starts, self._len = starts, total

    def __len__(self):
        return self._len

    def __getitem__(self, i: int) -> str:
        if not 0 <= i < self._len:
            raise IndexError(i)
        b = bisect.bisect_right(self._starts, i) - 1
        r, words = self._blocks[b]
        j = i - self._starts[b]
        return f"{r}-{self._nouns[j]}" if words is None else words[j]


@functools.lru_cache(maxsize=1)
def adj_noun_words() -> AdjNounWords:
    nouns, adjs, _ = sources.word_lists()
    return AdjNounWords(adjs, nouns)


def niah(run: Run) -> list[dict]:
    a = run.args
    rng = run.rng
    type_k, type_v, type_h = a["type_needle_k"], a["type_needle_v"], a["type_haystack"]
    num_k = max(a["num_needle_k"], a["num_needle_q"])
    num_v, num_q = a["num_needle_v"], a["num_needle_q"]
    if type_h == "essay":
        haystack = re.sub(r"\s+", " ", sources.essay_text(run.essays)).split(" ")
        split = sources.sentence_splitter(run.punkt)
    elif type_h == "repeat":
        haystack = NOISE
    elif type_h == "needle":
        haystack = NEEDLE
    else:
        raise InputError(f"ruler: type_haystack={type_h!r} is not implemented")
    words = adj_noun_words() if "words" in (type_k, type_v) else None

    def draw(kind: str) -> str:
        if kind == "numbers":
            return str(rng.randint(10 ** 6, 10 ** 7 - 1))
        if kind == "words":
            return rng.choice(words)
        if kind == "uuids":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        raise InputError(f"ruler: needle type {kind!r} is not implemented")

    template, shown_v = run.template, type_v
    answer_prefix = BASE_TASKS["niah"]["answer_prefix"]
    if num_q * num_v == 1:  # QUIRK: the whole prompt is edited, model template and answer prefix included
        def singular(t):
            return (t.replace("Some", "A").replace("are all", "is").replace("are", "is")
                    .replace("answers", "answer"))
        template, answer_prefix, shown_v = singular(template), singular(answer_prefix), type_v[:-1]
    prompt = Prompt(template, answer_prefix)

    def generate(num_haystack: int):
        keys, values, needles = [], [], []
        for _ in range(num_k):
            keys.append(draw(type_k))
            value = []
            for _ in range(num_v):
                value.append(draw(type_v))
                needles.append(NEEDLE.format(type_needle_v=type_v, key=keys[-1], value=value[-1]))
            values.append(value)
        random.Random(run.seed).shuffle(needles)
        if type_h == "essay":
            sentences = split(" ".join(haystack[:num_haystack]).strip())
            depths = rng.sample(DEPTHS, len(needles))
            cuts = [0] + sorted(int(len(sentences) * (d / 100)) for d in depths) + [len(sentences)]
            parts = []
            for i in range(1, len(cuts)):
                parts.append(" ".join(sentences[cuts[i - 1]:cuts[i]]))
                if i - 1 < len(needles):
                    parts.append(needles[i - 1])
            context = " ".join(parts)
        else:
            if type_h == "repeat":
                lines = [haystack] * num_haystack
            else:
                lines = [haystack.format(type_needle_v=type_v, key=draw(type_k), value=draw(type_v))
                         for _ in range(num_haystack)]
            for index, element in zip(sorted(rng.sample(range(num_haystack), len(needles)), reverse=True), needles):
                lines.insert(index, element)
            context = "\n".join(lines)
        indices = rng.sample(range(num_k), num_q)
        return context, [keys[i] for i in indices], [x for i in indices for x in values[i]]

    def make(num_haystack: int):
        context, queries, answers = generate(num_haystack)
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        text, query_at = prompt.fill(context, type_needle_v=shown_v, query=query)
        return text, answers, query_at, prompt.prefix(type_needle_v=shown_v, query=query)

    incremental = 500 if type_h == "essay" else 25
    if type_h != "essay" and run.max_seq_length < 4096:
        incremental = 5
    num_haystack, total = incremental, 0
    while total + run.tokens_to_generate < run.max_seq_length:
        text, answers, _, _ = make(num_haystack)
        total = run.count(text + " ".join(answers))   # QUIRK: no space between prompt and answers
        if total + run.tokens_to_generate > run.max_seq_length:
            num_haystack -= incremental
            break
        if type_h == "essay" and num_haystack > len(haystack):
            num_haystack = len(haystack)
            break
        num_haystack += incremental

    return [_row(run, index, *_fitted(run, make, num_haystack, incremental)) for index in range(run.num_samples)]


# ---------------------------------------------------------------------------------------- vt

def variable_tracking(run: Run) -> list[dict]:
    rng, nprng = run.rng, run.nprng
    num_chains, num_hops = run.args["num_chains"], run.args["num_hops"]
    base = BASE_TASKS["variable_tracking"]
    prompt = Prompt(run.template, base["answer_prefix"])
    # QUIRK: the in-prompt example drops the model template and, with it, the task template's last word
    cut, cut_answer = run.template.index(base["template"][:20]), run.template.index(base["answer_prefix"][:10])
    icl_template = " ".join(run.template[cut:cut_answer].split()[:-1]) + run.template[cut_answer:]

    def chains(is_icl: bool):
        k = 3 if is_icl else 5
        hops = min(10, num_hops) if is_icl else num_hops
        names = ["".join(rng.choices(string.ascii_uppercase, k=k)).upper() for _ in range((hops + 1) * num_chains)]
        while len(set(names)) < num_chains * (hops + 1):
            names.append("".join(rng.choices(string.ascii_uppercase, k=k)).upper())
        out_vars, out_chains = [], []
        for i in range(0, len(names), hops + 1):   # QUIRK: a repeated name adds a short chain (IndexError)
            these = names[i:i + hops + 1]
            out_vars.append(these)
            chain = [f"VAR {these[0]} = {nprng.randint(10000, 99999)}"]
            for j in range(hops):
                chain.append(f"VAR {these[j + 1]} = VAR {these[j]} ")
            out_chains.append(chain)
        return out_vars, out_chains

    def make(num_noises: int, is_icl: bool):
        names, all_chains = chains(is_icl)
        noise = NOISE + "\n"
        sentences = [noise] * num_noises
        if len(sentences) <= len(all_chains[0]):
            sentences = [n + "." if len(n.strip()) > 0 else n for n in [x for s in sentences for x in s.split(".")]]
            if not len(sentences) > len(all_chains[0]):
                all_chains = [chain[:len(sentences) - 1] for chain in all_chains]
        for chain in all_chains:
            positions = sorted(rng.sample(range(len(sentences)), len(chain)))
            for at, j in zip(positions, range(len(chain))):
                sentences.insert(at + j, chain[j])
        context = " ".join(sentences).replace(". \n", ".\n")
        value = all_chains[0][0].split("=")[-1].strip()
        fields = dict(query=value, num_v=num_hops + 1)
        if is_icl:
            return icl_template.format(context=context, **fields), names[0], None, None
        text, query_at = prompt.fill(context, **fields)
        return text, names[0], query_at, prompt.prefix(**fields)

    def samples(num_samples, max_seq_length, incremental=10, icl_example=None):
        is_icl = icl_example is None
        example_tokens = 0
        if icl_example is not None:
            icl_example = icl_example["input"] + " " + " ".join(icl_example["outputs"]) + "\n\n"
            example_tokens = run.count(icl_example)
        num_noises, total = incremental, 0
        while total + run.tokens_to_generate + example_tokens < max_seq_length:
            text, answer, _, _ = make(num_noises, is_icl)
            total = run.count(text + f" {answer}")   # QUIRK: the answer list's repr
            if total + run.tokens_to_generate + example_tokens > max_seq_length:
                num_noises -= incremental
                break
            num_noises += incremental
        rows = []
        for index in range(num_samples):
            text, answer, length, query_at, prefix = _fitted(run, lambda used: make(used, is_icl), num_noises,
                                                             incremental, example_tokens, max_seq_length)
            if icl_example is not None:
                cutoff = text.index(base["template"][:20])
                inserted = " " + icl_example + "\n\n"
                text, query_at = text[:cutoff] + inserted + text[cutoff:], query_at + len(inserted)
            if is_icl:
                rows.append({"index": index, "input": _collapse(text) if run.remove_newline_tab else text,
                             "outputs": answer, "length": length})
            else:
                rows.append(_row(run, index, text, answer, length, query_at, prefix))
        return rows

    example = samples(1, 500, incremental=5)[0]
    return samples(run.num_samples, run.max_seq_length, icl_example=example)


# --------------------------------------------------------------------------------------------- cwe

def common_words_extraction(run: Run) -> list[dict]:
    rng = run.rng
    num_cw = run.args["num_cw"]
    nouns, adjs, verbs = sources.word_lists()
    words = sorted(set(nouns + adjs + verbs))
    random.Random(run.seed).shuffle(words)
    prompt = Prompt(run.template, BASE_TASKS["common_words_extraction"]["answer_prefix"])

    def example(num_words, common_repeats, uncommon_repeats, common_nums):
        full = rng.sample(words, num_words)
        common, uncommon = full[:common_nums], full[common_nums:]
        word_list = common * int(common_repeats) + uncommon * int(uncommon_repeats)
        random.Random(run.seed).shuffle(word_list)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(word_list)), common

    def numbered(answer):
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(answer))

    def make(num_words):
        if run.max_seq_length < 4096:
            context_example, answer_example = example(20, 3, 1, num_cw)
            context, answer = example(num_words, 6, 1, num_cw)
        else:
            context_example, answer_example = example(40, 10, 3, num_cw)
            context, answer = example(num_words, run.args["freq_cw"], run.args["freq_ucw"], num_cw)
        shown_example = run.template.format(context=context_example, query="") + numbered(answer_example)
        text, query_at = prompt.fill(context, query="")
        return shown_example + "\n" + text, answer, len(shown_example) + 1 + query_at, prompt.prefix(query="")

    incremental = 10
    num_words, total = incremental, 0
    while total + run.tokens_to_generate < run.max_seq_length:
        text, answer, _, _ = make(num_words)
        total = run.count(text + " " + numbered(answer))
        if total + run.tokens_to_generate > run.max_seq_length:
            num_words -= incremental
            break
        num_words += incremental
        if num_words > len(words):
            num_words = len(words)
            break

    return [_row(run, index, *_fitted(run, make, num_words, incremental)) for index in range(run.num_samples)]


# --------------------------------------------------------------------------------------------- fwe

def _zeta(alpha: float) -> float:
    if alpha == 2.0:
        return math.pi ** 2 / 6   # == scipy.special.zeta(2.0), bit for bit
    try:
        from scipy.special import zeta
    except ImportError:
        raise InputError(f"ruler: fwe with alpha={alpha} needs scipy (RULER's scipy.special.zeta)") from None
    return float(zeta(alpha))


def freq_words_extraction(run: Run) -> list[dict]:
    rng = run.rng
    alpha = float(run.args["alpha"])
    coded_wordlen = int(run.args.get("coded_wordlen", 6))
    vocab_size = run.max_seq_length // 50 if run.args.get("vocab_size", -1) == -1 else run.args["vocab_size"]
    prompt = Prompt(run.template, BASE_TASKS["freq_words_extraction"]["answer_prefix"])
    z = _zeta(alpha)

    def generate(max_len, num_words=-1, incremental=10):
        vocab = ["".join(rng.choices(string.ascii_lowercase, k=coded_wordlen)) for _ in range(vocab_size)]
        while len(set(vocab)) < vocab_size:
            vocab.append("".join(rng.choices(string.ascii_lowercase, k=coded_wordlen)))
        vocab = sorted(set(vocab))
        random.Random(run.seed).shuffle(vocab)
        vocab[0] = "..."   # the top-ranked word is noise

        def text_of(n):
            k = np.arange(1, len(vocab) + 1)
            counts = n * (k ** -alpha) / z
            sampled = [w for w, c in zip(vocab, counts.astype(int)) for _ in range(c)]
            random.Random(run.seed).shuffle(sampled)
            text, query_at = prompt.fill(" ".join(sampled), query="")
            return text, vocab[1:4], query_at

        if num_words > 0:
            text, answer, query_at = text_of(num_words)
            while run.count(text) > max_len:
                num_words -= incremental
                text, answer, query_at = text_of(num_words)
        else:
            num_words = max_len // coded_wordlen
            text, answer, query_at = text_of(num_words)
            while run.count(text) < max_len:
                num_words += incremental
                text, answer, query_at = text_of(num_words)
            num_words -= incremental
        text, answer, query_at = text_of(num_words)
        return text, answer, query_at, num_words

    # QUIRK: the budget is max_seq_length itself, tokens to generate not taken off
    *_, num_example_words = generate(run.max_seq_length, incremental=run.max_seq_length // 32)
    rows = []
    for index in range(run.num_samples):
        text, answer, query_at, _ = generate(run.max_seq_length, num_words=num_example_words,
                                             incremental=run.max_seq_length // 32)
        length = run.count(text) + run.tokens_to_generate
        rows.append(_row(run, index, text, answer, length, query_at, prompt.prefix(query="")))
    return rows


# ---------------------------------------------------------------------------------------------- qa

def qa(run: Run) -> list[dict]:
    rng = run.rng
    dataset = run.args["dataset"]
    qas, docs = sources.qa_data(dataset, run.squad if dataset == "squad" else run.hotpotqa)
    if run.num_samples > len(qas):
        raise InputError(f"ruler: {run.task} asks for {run.num_samples} samples but the {dataset} json has "
                         f"{len(qas)} usable questions")
    prompt = Prompt(run.template, BASE_TASKS["qa"]["answer_prefix"])

    def make(index, num_docs):
        q = qas[index]
        own, more = q["context"], q.get("more_context", [])
        if num_docs < len(docs):
            if (num_docs - len(own)) > len(more):
                addition = [i for i, _ in enumerate(docs) if i not in own + more]
                chosen = own + more + rng.sample(addition, max(0, num_docs - len(own) - len(more)))
            else:
                chosen = own + rng.sample(more, num_docs - len(own))
            chosen = [docs[i] for i in chosen]
        else:
            chosen = docs   # QUIRK: the shuffle below then reorders the document list itself, for later samples
        random.Random(run.seed).shuffle(chosen)
        context = "\n\n".join(DOCUMENT_PROMPT.format(i=i + 1, document=d) for i, d in enumerate(chosen))
        text, query_at = prompt.fill(context, query=q["query"])
        return text, q["outputs"], query_at, prompt.prefix(query=q["query"])

    incremental = 10
    num_docs, total = incremental, 0
    while total + run.tokens_to_generate < run.max_seq_length:
        text, answer, _, _ = make(0, num_docs)
        total = run.count(text + f" {answer}")   # QUIRK: the answer list's repr
        if total + run.tokens_to_generate > run.max_seq_length:
            num_docs -= incremental
            break
        num_docs += incremental
        if num_docs > len(docs):
            num_docs = len(docs)
            break

    return [_row(run, index, *_fitted(run, lambda used, index=index: make(index, used), num_docs, incremental))
            for index in range(run.num_samples)]


GENERATORS = {"niah": niah, "variable_tracking": variable_tracking, "common_words_extraction": common_words_extraction,
              "freq_words_extraction": freq_words_extraction, "qa": qa}
