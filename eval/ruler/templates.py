"""RULER's templates and task settings, as data (hsiehjackson/RULER @ e40fae1).

- ``MODEL_TEMPLATES``: ``scripts/data/template.py`` (``{task_template}`` is where the task text goes);
- ``BASE_TASKS``: ``scripts/data/synthetic/constants.py`` (task template, answer prefix, tokens to
  generate) with the metric of ``scripts/eval/synthetic/constants.py``;
- ``TASK_CONFIGS``: ``scripts/synthetic.yaml`` (the 13 tasks, their base task and arguments), in file order.

The strings are RULER's, typos included ("assgined"), since they are part of every prompt.
"""
from __future__ import annotations

from snapkv.errors import InputError

MODEL_TEMPLATES = {
    "base": "{task_template}",
    "meta-chat": "[INST] {task_template} [/INST]",
    "vicuna-chat": "A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                   "helpful, detailed, and polite answers to the user's questions. USER: {task_template} ASSISTANT:",
    "lwm-chat": "You are a helpful assistant. USER: {task_template} ASSISTANT: ",
    "command-r-chat": "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|USER_TOKEN|>{task_template}<|END_OF_TURN_TOKEN|>"
                      "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    "chatglm-chat": "[gMASK]sop<|user|> \n {task_template}<|assistant|> \n ",
    "RWKV": "User: hi\n\nAssistant: Hi. I am your assistant and I will provide expert full response in full details. "
            "Please feel free to ask any question and I will always answer it\n\nUser: {task_template}\n\nAssistant:",
    "Phi3": "<|user|>\n{task_template}<|end|>\n<|assistant|>\n",
    "meta-llama3": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{task_template}<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "jamba": "<|startoftext|><|bom|><|system|> <|eom|><|bom|><|user|> {task_template}<|eom|><|bom|><|assistant|>",
}

BASE_TASKS = {
    "niah": {
        "tokens_to_generate": 128,
        "template": "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize "
                    "it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special "
                    "magic {type_needle_v} for {query} mentioned in the provided text?",
        "answer_prefix": " The special magic {type_needle_v} for {query} mentioned in the provided text are",
        "metric": "string_match_all",
    },
    "variable_tracking": {
        "tokens_to_generate": 30,
        "template": "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
                    "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.",
        "answer_prefix": " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
                         "variables are assgined the value {query}, they are: ",
        "metric": "string_match_all",
    },
    "common_words_extraction": {
        "tokens_to_generate": 120,
        "template": "Below is a numbered list of words. In these words, some appear more often than others. "
                    "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common "
                    "words in the above list?",
        "answer_prefix": " Answer: The top 10 words that appear most often in the list are:",
        "metric": "string_match_all",
    },
    "freq_words_extraction": {
        "tokens_to_generate": 50,
        "template": "Read the following coded text and track the frequency of each coded word. Find the three most "
                    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
                    "ignore the dots '....'. What are the three most frequently appeared words in the above coded "
                    "text?",
        "answer_prefix": " Answer: According to the coded text above, the three most frequently appeared words are:",
        "metric": "string_match_all",
    },
    "qa": {
        "tokens_to_generate": 32,
        "template": "Answer the question based on the given documents. Only give me the answer and do not output any "
                    "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on "
                    "the given documents. Only give me the answer and do not output any other words.\n\nQuestion: "
                    "{query}",
        "answer_prefix": " Answer:",
        "metric": "string_match_part",
    },
}


def _niah(haystack, k, v, nk=1, nv=1, nq=1):
    return ("niah", dict(type_haystack=haystack, type_needle_k=k, type_needle_v=v,
                         num_needle_k=nk, num_needle_v=nv, num_needle_q=nq))


TASK_CONFIGS = {
    "niah_single_1": _niah("repeat", "words", "numbers"),
    "niah_single_2": _niah("essay", "words", "numbers"),
    "niah_single_3": _niah("essay", "words", "uuids"),
    "niah_multikey_1": _niah("essay", "words", "numbers", nk=4),
    "niah_multikey_2": _niah("needle", "words", "numbers"),
    "niah_multikey_3": _niah("needle", "uuids", "uuids"),
    "niah_multivalue": _niah("essay", "words", "numbers", nv=4),
    "niah_multiquery": _niah("essay", "words", "numbers", nq=4),
    "vt": ("variable_tracking", dict(num_chains=1, num_hops=4)),
    "cwe": ("common_words_extraction", dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": ("freq_words_extraction", dict(alpha=2.0)),
    "qa_1": ("qa", dict(dataset="squad")),
    "qa_2": ("qa", dict(dataset="hotpotqa")),
}
TASKS = tuple(TASK_CONFIGS)


def check_task(task: str) -> str:
    if task not in TASK_CONFIGS:
        raise InputError(f"ruler.task: {task!r} is not a RULER synthetic task; allowed: {', '.join(TASKS)}")
    return task


def check_template(template: str) -> str:
    if template not in MODEL_TEMPLATES:
        raise InputError(f"ruler.template: {template!r} is not a RULER model template; allowed: "
                         f"{', '.join(MODEL_TEMPLATES)}")
    return template


def prompt_template(task: str, template: str = "base") -> str:
    """The ``--template`` that RULER's prepare.py hands the task script: the model template around the
    task template, then the answer prefix (fields ``{context}``, ``{query}``, ... still to fill)."""
    base = BASE_TASKS[TASK_CONFIGS[check_task(task)][0]]
    return MODEL_TEMPLATES[check_template(template)].format(task_template=base["template"]) + base["answer_prefix"]


def wrap(text: str, template: str) -> str:
    """``text`` inside a RULER model template (e.g. a sample's question part, without its answer prefix:
    ``wrap(input[:-len(answer_prefix)], "meta-chat") + answer_prefix``). To get RULER's exact prompts for
    a model template, pass ``template=`` to ``generate`` instead: RULER fits the haystack with the
    template's tokens counted, and cwe's in-prompt example is wrapped too."""
    return MODEL_TEMPLATES[check_template(template)].format(task_template=text)
