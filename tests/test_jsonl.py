import pytest

from eval.jsonl import append_record, read_records


def test_writer_cuts_a_half_written_last_line_and_redoes_it(tmp_path):
    path = tmp_path / "pred.jsonl"
    append_record(path, {"_id": "a"})
    append_record(path, {"_id": "b"})
    with path.open("a") as f:
        f.write('{"_id": "c", "pred": "trunc')
    assert [r["_id"] for r in read_records(path, repair=True)] == ["a", "b"]
    append_record(path, {"_id": "c"})
    assert [r["_id"] for r in read_records(path)] == ["a", "b", "c"]


def test_reading_never_changes_the_file(tmp_path):
    path = tmp_path / "pred.jsonl"
    path.write_text('{"_id": "a"}\n{"_id": "b"}')  # made elsewhere: no final newline
    before = path.read_bytes()
    assert [r["_id"] for r in read_records(path)] == ["a", "b"]
    assert path.read_bytes() == before
    path.write_text('{"_id": "a"}\n{"_id": "b", "pr')
    before = path.read_bytes()
    with pytest.raises(ValueError, match=r"pred.jsonl:2: the last line is incomplete"):
        read_records(path)
    assert path.read_bytes() == before


def test_writer_keeps_a_complete_last_line_without_newline(tmp_path):
    path = tmp_path / "pred.jsonl"
    path.write_text('{"_id": "a"}')
    assert [r["_id"] for r in read_records(path, repair=True)] == ["a"]
    append_record(path, {"_id": "b"})
    assert [r["_id"] for r in read_records(path)] == ["a", "b"]


def test_malformed_line_in_the_middle_names_file_and_line(tmp_path):
    path = tmp_path / "pred.jsonl"
    path.write_text('{"_id": "a"}\nnot json\n{"_id": "b"}\n')
    with pytest.raises(ValueError, match=r"pred.jsonl:2"):
        read_records(path)
