"""Official LongBench metrics pinned on hand-made cases, quirks included."""
import pytest

from eval.longbench.metrics import (classification_score, code_sim_score, count_score, dataset_score,
                                    dataset_score_e, difflib_ratio, qa_f1, qa_f1_zh, retrieval_score,
                                    retrieval_zh_score, rouge_l, rouge_l_zh, score_sample)


def test_qa_f1_normalizes_case_punctuation_articles():
    assert qa_f1("The Eiffel Tower!", "eiffel tower") == 1.0
    assert qa_f1("a red car", "the blue car") == pytest.approx(0.5)
    assert qa_f1("", "anything") == 0.0


def test_qa_f1_zh_uses_jieba_words():
    assert qa_f1_zh("北京是中国的首都。", "北京是中国的首都") == 1.0
    assert 0 < qa_f1_zh("北京", "北京是首都") < 1


def test_rouge_quirk_failure_scores_zero():
    assert rouge_l("", "some reference") == 0.0  # rouge raises on an empty hypothesis: bare except -> 0.0
    assert rouge_l("the cat sat", "the cat sat") == pytest.approx(1.0)
    assert 0 < rouge_l_zh("今天天气很好", "今天天气不错") < 1


def test_count_and_retrieval_scores():
    assert count_score("There are 3 unique paragraphs, not 4.", "3") == 0.5
    assert count_score("no numbers", "3") == 0.0
    assert retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert retrieval_score("It is paragraph 2 or 12", "Paragraph 12") == 0.5
    assert retrieval_zh_score("段落5", "段落5") == 1.0


def test_code_sim_first_line_without_comment_quirk():
    assert code_sim_score("```python\n# comment\nreturn x + 1\n", "return x + 1") == 1.0
    assert code_sim_score("// c comment\nint a = 0;", "int a = 0;") == 1.0
    assert code_sim_score("# only comments", "x = 1") == 0.0


def test_code_sim_of_empty_prediction_and_empty_answer_is_full_marks():
    # official fuzz.ratio checks equality before emptiness: fuzz.ratio("", "") == 100
    assert difflib_ratio("", "") == 100
    assert code_sim_score("", "") == 1.0
    assert code_sim_score("# only a comment", "") == 1.0  # compared as "" (first-line quirk)
    assert code_sim_score("", "x = 1") == 0.0


def test_difflib_ratio_is_fuzzywuzzy_on_difflib():
    assert difflib_ratio("abcd", "abce") == 75
    assert difflib_ratio("", "x") == 0
    from fuzzywuzzy import fuzz
    import fuzzywuzzy.fuzz as fz
    if getattr(fz, "SequenceMatcher", None).__module__ == "difflib":
        for a, b in [("return a + b", "return a+b"), ("foo(bar)", "foo(baz, qux)"), ("", ""), ("", "x")]:
            assert difflib_ratio(a, b) == fuzz.ratio(a, b)


def test_classification_substring_removal_quirk():
    classes = ["Location", "Other location", "Manner"]
    # both names appear; "Location" is a substring of the truth "Other location"? no: case differs
    assert classification_score("Other location", "Other location", all_classes=classes) == 1.0
    # "location" in truth and != truth is removed; the element after it is skipped by the quirk
    classes = ["loc", "ation", "location"]
    # matches = [loc, ation, location]; "loc" removed -> list shifts, "ation" is skipped (kept)
    assert classification_score("location", "location", all_classes=classes) == pytest.approx(0.5)
    assert classification_score("nothing", "location", all_classes=classes) == 0.0


def test_first_line_rule_and_max_over_answers():
    assert score_sample("trec", "\nLocation\nManner", ["Location"], ["Location", "Manner"]) == 1.0
    assert score_sample("qasper", "Paris", ["London", "paris"]) == 1.0
    assert score_sample("triviaqa", "Paris\nLondon", ["London"]) == 0.0
    assert score_sample("qasper_e", "Paris", ["paris"]) == 1.0
    with pytest.raises(ValueError, match="dataset"):
        score_sample("nope", "x", ["x"])


def test_dataset_scores_and_e_buckets():
    rows = [{"pred": "a b", "answers": ["a b"], "all_classes": None, "length": 100},
            {"pred": "c", "answers": ["d"], "all_classes": None, "length": 5000}]
    assert dataset_score("hotpotqa", rows) == 50.0
    assert dataset_score_e("hotpotqa", rows) == {"0-4k": 100.0, "4-8k": 0.0, "8k+": None}
