"""A seeded LongEval-Lines generator (written here; nothing is downloaded).

Each line reads ``line makeshift-penguin: REGISTER_CONTENT is <10536>``: a key of two random words
and a random value. The record of lines is followed by the question for one line's value; its
depth percent places the asked line among the lines (0 = the first line, 100 = the last).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from ..chat import encode_chat
from snapkv.errors import InputError

ADJECTIVES = (
    "makeshift ancient brave calm crooked dizzy eager fancy gentle hollow icy jolly keen lively mellow noisy "
    "odd proud quick rapid shy tidy upbeat vivid witty young zealous bitter breezy cheerful clumsy dusty elegant "
    "faint fuzzy grumpy hasty humble itchy jumpy lazy lucky misty narrow nimble orange plain quiet rusty sandy "
    "silent sleepy smooth sturdy sunny tame tiny torpid vast wary wild windy wooden yellow zesty").split()
NOUNS = (
    "penguin anchor badger beacon candle canyon dolphin ember falcon feather garden glacier harbor hammer island "
    "jacket kettle lantern meadow mirror nectar otter pebble pillar quarry rabbit river saddle shadow spindle "
    "tablet thunder tulip umbrella valley walnut willow window yarn zephyr acorn basket bridge cactus cobble "
    "dragon engine forest goblet hazel igloo jungle kite lemon magnet noodle orchard parrot quilt rocket summit "
    "tiger violin wagon").split()

INTRO = ("Below is a record of lines to remember. Each line starts with 'line' and a two-word index, and "
         "ends with its REGISTER_CONTENT, a number. Memorize the REGISTER_CONTENT of every line index; after "
         "the record you will be asked for the REGISTER_CONTENT of one line index.\n\nThe record starts:\n\n")
QUESTION = ("\nThe record is over. What is the REGISTER_CONTENT in line {key}? Answer with the number only.")


@dataclass(frozen=True)
class Line:
    key: str
    value: int

    def text(self) -> str:
        return f"line {self.key}: REGISTER_CONTENT is <{self.value}>\n"


def make_lines(count: int, seed: int) -> list[Line]:
    """``count`` lines with distinct keys and values drawn from ``random.Random(seed)``."""
    pairs = [(a, n) for a in ADJECTIVES for n in NOUNS]
    if count > len(pairs):
        raise InputError(f"lines: {count} lines asked, the generator has {len(pairs)} distinct keys")
    rng = random.Random(seed)
    keys = rng.sample(pairs, count)
    return [Line(f"{a}-{n}", rng.randint(1, 50000)) for a, n in keys]


def asked_index(count: int, depth: float) -> int:
    return round(depth / 100 * (count - 1))


def prompt_text(lines: list[Line], asked: Line) -> str:
    return INTRO + "".join(line.text() for line in lines) + QUESTION.format(key=asked.key)


class LinesPrompts:
    """Prompts of a target token length: as many lines as fit, counted with the model's tokenizer."""

    def __init__(self, tokenizer, chat_format: str, seed: int, pool: int):
        self.tokenizer, self.chat_format = tokenizer, chat_format
        self.lines = make_lines(pool, seed)
        sizes = [len(tokenizer(line.text(), add_special_tokens=False).input_ids) for line in self.lines]
        self.cumulative = [0]
        for size in sizes:
            self.cumulative.append(self.cumulative[-1] + size)
        self.frame = len(self.ids(self.lines[:0], self.lines[0]))

    def ids(self, lines: list[Line], asked: Line) -> list[int]:
        return encode_chat(self.tokenizer, prompt_text(lines, asked), self.chat_format)

    def count_for(self, length: int) -> int:
        budget = length - self.frame
        count = max(i for i, total in enumerate(self.cumulative) if total <= budget) if budget > 0 else 0
        if count < 1:
            raise InputError(f"lines.lengths: {length} tokens hold no line (the prompt's fixed part is {self.frame} "
                             "tokens)")
        if count == len(self.lines):
            raise InputError(f"lines.lengths: {length} tokens need more than the {len(self.lines)} generated lines; "
                             "raise lines.pool")
        return count

    def build(self, length: int, depth: float) -> tuple[list[int], Line, int, int]:
        """``(ids, asked line, its index, lines in the prompt)``."""
        count = self.count_for(length)
        index = asked_index(count, depth)
        asked = self.lines[index]
        return self.ids(self.lines[:count], asked), asked, index, count


def exact_value(response: str, value: int) -> float:
    """1 when the first number in the response is the asked value (LongEval's check), else 0."""
    numbers = re.findall(r"\d+", response)
    return float(bool(numbers) and int(numbers[0]) == value)
