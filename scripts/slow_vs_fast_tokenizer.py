"""Measure whether transformers 5's (fast) tokenizer gives the ids a sentencepiece ("slow")
tokenizer gives on real LongBench prompts, as SnapKV's pred_snap.py builds them.

pred_snap.py loads LWM, LongChat and Mistral with ``use_fast=False`` (sentencepiece); transformers
5 has no slow tokenizers. The slow LlamaTokenizer, on text without special tokens, is BOS +
``SentencePieceProcessor.encode(text)``; the fast one is what transformers converts the same
``tokenizer.model`` into. Needs ``pip install sentencepiece protobuf`` (not project dependencies).

    python scripts/slow_vs_fast_tokenizer.py TOKENIZER_MODEL DATASET.jsonl [CHAT_FORMAT] [MAX_LENGTH]
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path


def fast_from_sentencepiece(model_file: Path):
    from transformers import AutoTokenizer
    folder = Path(tempfile.mkdtemp())
    shutil.copy(model_file, folder / "tokenizer.model")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "legacy": True}))
    return AutoTokenizer.from_pretrained(folder)


def main(model_file: str, data: str, chat_format: str = "none", max_length: int = 31500) -> int:
    import sentencepiece
    from eval.chat import format_chat
    from eval.longbench.data import read_dataset
    from eval.longbench.prompt import NO_CHAT_DATASETS, PROMPTS

    slow = sentencepiece.SentencePieceProcessor(model_file=model_file)
    fast = fast_from_sentencepiece(Path(model_file))
    rows = read_dataset(Path(data))
    differ, tokens, first = 0, 0, None
    for row in rows:
        dataset = row["dataset"]
        prompt = PROMPTS[dataset].format(**row)
        ids = [slow.bos_id()] + slow.encode(prompt)
        if len(ids) > max_length:  # middle truncation on the slow ids, as pred_snap.py on its tokenizer
            half = int(max_length / 2)
            prompt = slow.decode(ids[:half][1:]) + slow.decode(ids[-half:])
        if dataset not in NO_CHAT_DATASETS:
            prompt, _ = format_chat(None, prompt, chat_format)
        slow_ids = [slow.bos_id()] + slow.encode(prompt)
        fast_ids = fast(prompt).input_ids
        tokens += len(slow_ids)
        if slow_ids != fast_ids:
            differ += 1
            if first is None:
                at = next((i for i, (a, b) in enumerate(zip(slow_ids, fast_ids)) if a != b),
                          min(len(slow_ids), len(fast_ids)))
                first = (row["_id"], at, slow_ids[at:at + 5], fast_ids[at:at + 5])
    print(f"{len(rows)} prompts ({tokens} slow tokens): {differ} differ between slow and fast ids")
    if first:
        print(f"first difference: row {first[0]} at token {first[1]}: slow {first[2]} vs fast {first[3]}")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) < 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(args[0], args[1], *(args[2:3] or []), *([int(args[3])] if len(args) > 3 else [])))
