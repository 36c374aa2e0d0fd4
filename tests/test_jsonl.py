import pytest

from eval.jsonl import append_record, read_records


def test_half_written_last_line_is_cut_and_redone(tmp_path):
    path = tmp_path / "pred.jsonl"
    append_record(path, {"_id": "a"})
    append_record(path, {"_id": "b"})
    with path.open("a") as f:
        f.write('{"_id": "c", "pred": "trunc')
    assert [r["_id"] for r in read_records(path)] == ["a", "b"]
    append_record(path, {"_id": "c"})
    assert [r["_id"] for r in read_records(path)] == ["a", "b", "c"]


def test_malformed_line_in_the_middle_names_file_and_line(tmp_path):
    path = tmp_path / "pred.jsonl"
    path.write_text('{"_id": "a"}\nnot json\n{"_id": "b"}\n')
    with pytest.raises(ValueError, match=r"pred.jsonl:2"):
        read_records(path)
