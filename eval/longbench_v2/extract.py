"""The answer letter of a response: ``extract_answer`` of THUDM/LongBench ``pred.py``, verbatim."""
from __future__ import annotations

import re


def extract_answer(response: str) -> str | None:
    """``*`` removed, then "The correct answer is (X)", then "The correct answer is X" (X in A-D; the
    first match in the text); None when neither is there."""
    response = response.replace('*', '')
    match = re.search(r'The correct answer is \(([A-D])\)', response)
    if match:
        return match.group(1)
    else:
        match = re.search(r'The correct answer is ([A-D])', response)
        if match:
            return match.group(1)
        else:
            return None
