"""Where RULER's data comes from (eval/ruler): the Paul Graham essays downloaded as RULER's
download_paulgraham_essay.py does (from a server on 127.0.0.1 here; nothing leaves the machine), cached
and reused offline; and ``ruler.source=kvpress``, kvpress's RULER set (simonjegou/ruler) read from a
local copy in its schema (tests/fixtures/kvpress_ruler, made by its make_fixture.py)."""
import functools
import hashlib
import json
import socket
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import compose
from eval.ruler import kvpress, sources
from eval.ruler.generate import parts
from eval.ruler.predict import RulerTask, Sample
from snapkv.errors import InputError

FIXTURES = Path(__file__).resolve().parent / "fixtures"
KVPRESS_ROWS = FIXTURES / "kvpress_ruler" / "ruler_1024_tiny.jsonl"


@pytest.fixture(autouse=True)
def isolated(monkeypatch):
    monkeypatch.delenv(sources.ESSAY_URLS_ENV, raising=False)
    kvpress._load.cache_clear()
    yield
    kvpress._load.cache_clear()


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """An empty cache (the essays' tests; the others keep the shared one, where the tokenizer is converted)."""
    monkeypatch.setenv("SNAPKV_BENCH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# ------------------------------------------------------------------------------------ the essays

class _Handler(SimpleHTTPRequestHandler):
    def do_GET(self):
        if "boom" in self.path:
            self.send_error(503)
            return
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture
def server(tmp_path, cache):
    """A file server on 127.0.0.1 (an ephemeral port) for ``tmp_path/www``; stopped after the test."""
    root = tmp_path / "www"
    root.mkdir()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, directory=str(root)))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


PAGES = {  # paulgraham.com-like pages, and what RULER's conversion makes of them (html2text 2024.2.26)
    "y.html": ('<html><body><font size="2" face="verdana">April 2001<br><br>Caf\u00e9 owners <i>know</i> this, '
               'see <a href="http://x.com/a">here</a>.<br><br>Second paragraph.</font><font>ignored</font>'
               '</body></html>',
               # unicode_escape decoding: the UTF-8 bytes of "é" come out as two Latin-1 characters
               "April 2001  \n  \nCaf\u00c3\u00a9 owners _know_ this, see [here](http://x.com/a).  \n  \n"
               "Second paragraph.\n\n"),
    "z.html": ('<html><body><img src="t.gif"><table><tr><td><font size="2" face="verdana">Z essay: 1. not a list * '
               'and_under.<br><br>Last line.</font></td></tr></table></body></html>',
               "Z essay: 1. not a list * and_under.  \n  \nLast line.\n\n"),
    "nofont.html": ("<html><body><p>No font here.</p></body></html>", "None\n\n"),  # RULER: str(None)
    "escape.html": ("<font>a \\x backslash</font>", None),  # unicode_escape fails: RULER drops the essay
}


def _site(root: Path, base: str, extra_urls=()) -> Path:
    (root / "gh").mkdir()
    (root / "pg").mkdir()
    (root / "gh" / "b.txt").write_bytes("Essay B, line one.\r\nLine two.\rEnd \u00e9.\n".encode())
    (root / "gh" / "a.txt").write_bytes(b"Essay A.\n")
    for name, (html, _) in PAGES.items():
        (root / "pg" / name).write_bytes(html.encode())
    urls = [f"{base}/pg/z.html", f"{base}/gh/b.txt", f"{base}/pg/y.html", f"{base}/pg/gone.html",
            f"{base}/pg/nofont.html", f"{base}/gh/a.txt", f"{base}/pg/escape.html", *extra_urls]
    listing = root.parent / "urls.txt"
    listing.write_text("\n".join(urls))
    return listing


# RULER's order: the text files by name, then the pages by name; \r\n and \r read back as \n
EXPECTED = ("Essay A.\n" + "Essay B, line one.\nLine two.\nEnd \u00e9.\n"
            + PAGES["nofont.html"][1] + PAGES["y.html"][1] + PAGES["z.html"][1])


def test_essays_download_as_rulers_script_then_come_from_the_cache(server, cache, monkeypatch, capsys):
    root, base = server
    monkeypatch.setenv(sources.ESSAY_URLS_ENV, str(_site(root, base)))
    cached = sources.essays_cache_file()
    assert cached.parent == cache / "ruler" and cached.name.startswith("PaulGrahamEssays-")  # not RULER's list
    assert sources.essay_text(None) == EXPECTED
    saved = json.loads(cached.read_text())
    assert saved["text"] == EXPECTED
    assert saved["failed"] == ["gone.txt (HTTP 404)", "escape.txt (LookupError)"]
    err = capsys.readouterr().err
    assert "2 essay files and 3 essay pages" in err and "gone.txt (HTTP 404)" in err
    assert not [p for p in cached.parent.iterdir() if p.name.startswith(".")]  # no temporary files left

    def no_network(url, dest):
        raise AssertionError(f"the cache should serve, not {url}")
    monkeypatch.setattr(sources, "fetch", no_network)
    assert sources.essay_text(None) == EXPECTED


def test_essays_offline_is_one_line_naming_the_field(tmp_path, monkeypatch, cache):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    listing = tmp_path / "urls.txt"
    listing.write_text(f"http://127.0.0.1:{port}/gh/a.txt\nhttp://127.0.0.1:{port}/pg/b.html\n")
    monkeypatch.setenv(sources.ESSAY_URLS_ENV, str(listing))
    with pytest.raises(InputError) as err:
        sources.essay_text(None)
    message = str(err.value)
    assert message.startswith(f"ruler.essays: no essays given and http://127.0.0.1:{port}/gh/a.txt is unreachable")
    assert "ruler.essays=PATH" in message and "\n" not in message
    assert not sources.essays_cache_file().exists()


def test_a_server_error_stops_the_download_and_caches_nothing(server, monkeypatch):
    root, base = server
    monkeypatch.setenv(sources.ESSAY_URLS_ENV, str(_site(root, base, extra_urls=[f"{base}/pg/boom.html"])))
    with pytest.raises(InputError, match=r"^ruler\.essays: no essays given and .*/pg/boom\.html is unreachable "
                                         r"\(HTTPError\)"):
        sources.essay_text(None)
    assert not sources.essays_cache_file().exists()


def test_a_local_copy_is_still_read(tmp_path):
    (tmp_path / "PaulGrahamEssays.json").write_text(json.dumps({"text": "From RULER's own file."}))
    assert sources.essay_text(tmp_path) == sources.essay_text(tmp_path / "PaulGrahamEssays.json") \
        == "From RULER's own file."
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "b.txt").write_text("B.")
    (tmp_path / "txt" / "a.txt").write_text("A.")
    assert sources.essay_text(tmp_path / "txt") == "A.B."


def test_the_shipped_url_list_is_rulers(cache):
    data = sources.ESSAY_URLS_FILE.read_bytes()
    assert hashlib.sha256(data).hexdigest() == "9862c06b4303b7bb6fe4c4a88671c51d2d36ec65757db54730c703d9cf474099"
    urls = sources.essay_urls()
    assert sources.essay_urls_file() == sources.ESSAY_URLS_FILE and sources.essays_cache_file().name == \
        "PaulGrahamEssays.json"
    gh = [u for u in urls if u.startswith("https://github.com/gkamradt/LLMTest_NeedleInAHaystack/raw/main/")]
    pg = [u for u in urls if u.startswith("http://www.paulgraham.com/") and u.endswith(".html")]
    assert len(urls) == 218 and len(gh) == 49 and len(pg) == 169


def test_the_download_of_the_shared_essays_equals_the_pinned_haystack(server, monkeypatch, shared_dir):
    """RULER's 49 text-file essays, served locally under their own names: the downloaded haystack is the
    one tests/fixtures/ruler pins RULER's generator on (essays.sha256)."""
    folder = shared_dir / "haystack" / "paul_graham_essays"
    if not folder.is_dir():
        pytest.skip("../shared/haystack/paul_graham_essays is not present")
    root, base = server
    (root / "gh").mkdir()
    urls = []
    for url in sources.essay_urls():
        if url.endswith(".txt"):
            name = url.rsplit("/", 1)[1]
            (root / "gh" / name).write_bytes((folder / name).read_bytes())
            urls.append(f"{base}/gh/{name}")
    (root.parent / "urls.txt").write_text("\n".join(urls))
    monkeypatch.setenv(sources.ESSAY_URLS_ENV, str(root.parent / "urls.txt"))
    text = sources.essay_text(None)
    want = (FIXTURES / "ruler" / "essays.sha256").read_text().split()[0]
    assert hashlib.sha256(text.encode()).hexdigest() == want


# -------------------------------------------------------------------------------- kvpress's data

def _kvpress_rows():
    return [json.loads(line) for line in KVPRESS_ROWS.read_text().splitlines()]


def _hub_layout(folder: Path, length: int = 1024) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    (folder / str(length)).mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(_kvpress_rows()), folder / str(length) / "test-00000-of-00001.parquet")
    (folder / "README.md").write_text("configs: ...")
    return folder


def test_kvpress_rows_become_ruler_rows():
    rows, source = kvpress.load(KVPRESS_ROWS, 1024)
    assert source == str(KVPRESS_ROWS.resolve())
    assert list(rows) == ["vt", "niah_single_1", "niah_multikey_2", "qa_1"]  # the file's order
    raw = _kvpress_rows()
    for task, task_rows in rows.items():
        want = [r for r in raw if r["task"] == task]
        assert [r["index"] for r in task_rows] == list(range(len(want))) == [0, 1]
        for row, kv in zip(task_rows, want):
            assert parts(row) == (kv["context"], kv["question"], kv["answer_prefix"])
            assert row["outputs"] == kv["answer"] and row["max_new_tokens"] == kv["max_new_tokens"]
            assert row["length"] is None


def test_kvpress_data_reads_parquet_json_and_the_hubs_layout(tmp_path):
    want, _ = kvpress.load(KVPRESS_ROWS, 1024)
    hub = _hub_layout(tmp_path / "hub")
    assert kvpress.load(hub, 1024)[0] == want
    assert kvpress.load(hub, 1024, lengths=2)[0] == want  # one folder per length: several lengths are fine
    assert kvpress.load(hub / "1024" / "test-00000-of-00001.parquet", 1024)[0] == want
    (tmp_path / "rows.json").write_text(json.dumps(_kvpress_rows()))
    assert kvpress.load(tmp_path / "rows.json", 1024)[0] == want
    columns = {c: {str(i): r[c] for i, r in enumerate(_kvpress_rows())} for c in kvpress.COLUMNS}
    (tmp_path / "columns.json").write_text(json.dumps(columns))  # pandas' DataFrame.to_json()
    assert kvpress.load(tmp_path / "columns.json", 1024)[0] == want


@pytest.mark.parametrize("make, length, lengths, message", [
    (lambda d: d / "none.jsonl", 1024, 1, r"^ruler\.kvpress_data=.*none\.jsonl: no such file or folder"),
    (lambda d: KVPRESS_ROWS, 1024, 2, r"^ruler\.kvpress_data=.*: holds one length's rows, and ruler\.lengths has 2"),
    (lambda d: _hub_layout(d / "hub"), 4096, 1, r"^ruler\.lengths: .*hub has no 4096/ folder"),
    (lambda d: (d / "x.jsonl").write_text('{"context": "c", "question": "q"}\n') and d / "x.jsonl", 1024, 1,
     r"^ruler\.kvpress_data=.*x\.jsonl:0: not kvpress's RULER schema: no answer_prefix, answer, task"),
    (lambda d: (d / "x.csv").write_text("a") and d / "x.csv", 1024, 1, r"^ruler\.kvpress_data=.*x\.csv: not a"),
])
def test_kvpress_data_errors_name_the_field(tmp_path, make, length, lengths, message):
    with pytest.raises(InputError, match=message):
        kvpress.load(make(tmp_path), length, lengths)


def test_kvpress_hub_cached_or_unreachable(tmp_path, monkeypatch):
    import huggingface_hub
    snapshot = _hub_layout(tmp_path / "datasets--simonjegou--ruler" / "snapshots" / "0123abc")
    calls = []

    def cached(repo, repo_type, allow_patterns):
        calls.append((repo, repo_type, allow_patterns))
        return str(snapshot)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", cached)
    rows, source = kvpress.load(None, 1024)
    assert calls == [("simonjegou/ruler", "dataset", ["1024/*"])] and source == "hub:simonjegou/ruler@0123abc"
    assert rows == kvpress.load(KVPRESS_ROWS, 1024)[0]

    def offline(*_, **__):
        raise ConnectionError("Failed to resolve 'huggingface.co'\nmore")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    kvpress._load.cache_clear()
    with pytest.raises(InputError) as err:
        kvpress.load(None, 1024)
    assert str(err.value).startswith("ruler.kvpress_data: no local copy given and simonjegou/ruler (1024) could not "
                                     "be read from the Hugging Face hub (ConnectionError: Failed to resolve")
    assert "ruler.kvpress_data=DIR" in str(err.value) and "\n" not in str(err.value)


def test_kvpress_prompts_are_built_as_kvpress_pipeline_builds_them(smol_tokenizer):
    row = kvpress.load(KVPRESS_ROWS, 1024)[0]["niah_single_1"][0]
    kv = [r for r in _kvpress_rows() if r["task"] == "niah_single_1"][0]
    ids, question = kvpress.encode(smol_tokenizer, row, "template")
    separator = "#" * (len(kv["context"]) + 10)
    text = smol_tokenizer.apply_chat_template([{"role": "user", "content": kv["context"] + separator}],
                                              add_generation_prompt=True, tokenize=False, enable_thinking=False)
    head, suffix = text.split(separator)
    want_q = smol_tokenizer.encode(kv["question"] + suffix + kv["answer_prefix"], add_special_tokens=False)
    assert ids == smol_tokenizer.encode(head, add_special_tokens=False) + want_q and question == len(want_q)
    tail = smol_tokenizer.decode(ids[-question:])
    assert tail == kv["question"] + "<|im_end|>\n<|im_start|>assistant\n" + kv["answer_prefix"]
    ids, question = kvpress.encode(smol_tokenizer, row, "none")  # kvpress without a chat template
    assert smol_tokenizer.decode(ids[:-question]) == smol_tokenizer.bos_token + kv["context"]
    assert smol_tokenizer.decode(ids[-question:]) == kv["question"] + "\n" + kv["answer_prefix"]
    assert kvpress.encode(smol_tokenizer, row, "llama2") is None  # no kvpress counterpart: wrapped as generated


def _ruler(*overrides):
    """The ruler config; ``ruler.source`` / ``ruler.kvpress_data`` appended where the schema lacks them."""
    known = "source" in compose("ruler", ["model=tiny-llama"]).ruler
    extra = [o if known or not o.startswith(("ruler.source=", "ruler.kvpress_data=")) else "+" + o
             for o in overrides]
    return compose("ruler", ["model=tiny-llama", "ruler.lengths=[1024]", *extra])


def test_kvpress_source_items_settings_and_prompts(smol_tokenizer, capsys):
    cfg = _ruler("ruler.source=kvpress", f"ruler.kvpress_data={KVPRESS_ROWS}", "ruler.tasks=[niah_single_1,qa_1]",
                 "ruler.samples=5")
    task = RulerTask()
    task.check(cfg)
    items = task.items(cfg)
    assert [i.key for i in items] == [(1024, t, i) for t in ("niah_single_1", "qa_1") for i in (0, 1)]
    assert "kvpress's data has 2 samples of niah_single_1 at 1024; running those (ruler.samples=5)" \
        in capsys.readouterr().out
    settings = task.settings(cfg)
    assert settings["ruler.source"] == "kvpress" and settings["ruler.kvpress_data"] == str(KVPRESS_ROWS.resolve())
    assert settings["ruler.seed"] is None and settings["ruler.essays"] is None
    task.prepare(cfg, smol_tokenizer, items)
    prompt = task.prompt(Sample("qa_1", 1024, 1), type("M", (), {"generation_config": None})(), smol_tokenizer)
    kv = [r for r in _kvpress_rows() if r["task"] == "qa_1"][1]
    assert smol_tokenizer.decode(prompt.ids[-prompt.question_tokens:]).startswith(kv["question"])
    assert prompt.max_new_tokens == 32 and prompt.fields["outputs"] == kv["answer"]

    generated = _ruler("ruler.tasks=[vt]")
    RulerTask().check(generated)
    assert RulerTask().settings(generated) == {"ruler.source": None, "ruler.kvpress_data": None}


@pytest.mark.parametrize("overrides, message", [
    (["ruler.source=kvpress", "ruler.template=base"], r"^ruler\.template='base': ruler\.source=kvpress"),
    (["ruler.source=made_up"], r"^ruler\.source='made_up' is not allowed; choose one of generate, kvpress"),
    ([f"ruler.kvpress_data={KVPRESS_ROWS}"], r"^ruler\.kvpress_data=.*: read only with ruler\.source=kvpress"),
    (["ruler.source=kvpress", f"ruler.kvpress_data={KVPRESS_ROWS}", "ruler.tasks=[cwe]"],
     r"^ruler\.tasks: cwe has no rows in kvpress's data"),
])
def test_kvpress_source_bad_settings_name_the_field(overrides, message):
    cfg = _ruler(*overrides)
    with pytest.raises(InputError, match=message):
        task = RulerTask()
        task.check(cfg)
        task.items(cfg)


def test_kvpress_source_runs_query_agnostic(tmp_path):
    from eval.ruler.__main__ import run
    cfg = _ruler("ruler.source=kvpress", f"ruler.kvpress_data={KVPRESS_ROWS}", "ruler.tasks=[niah_single_1]",
                 "ruler.samples=1", "query_aware=false", "compressor.budget=64", "compressor.window=8",
                 f"output_dir={tmp_path}/run")
    scores = run(cfg)
    assert list(scores["1024"]["tasks"]) == ["niah_single_1"] and scores["1024"]["counts"]["niah_single_1"][
        "samples"] == 1
    record = json.loads((tmp_path / "run" / "pred" / "1024" / "niah_single_1.jsonl").read_text())
    kv = [r for r in _kvpress_rows() if r["task"] == "niah_single_1"][0]
    assert record["index"] == 0 and record["outputs"] == kv["answer"] and record["length"] is None
    settings = json.loads((tmp_path / "run" / "settings.json").read_text())
    assert settings["ruler.source"] == "kvpress" and settings["query_aware"] is False
