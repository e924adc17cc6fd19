"""RULER's synthetic tasks as lctrain builds them (Hsieh et al. 2024, "RULER: What's the Real
Context Size of Your Long-Context Language Models?", arXiv:2404.06654; the reference
generators are NVIDIA/RULER's scripts/data/synthetic/ and lm-eval's tasks/ruler/).

Each task drafts a sample: the template's text before and after the context (with the
answer prefix), the expected strings (RULER's `outputs`, in its order), how the answer is
laid out, and a function that builds the context to a budget of tokens. Templates,
needle and haystack types, needle counts, chain hops and word-frequency parameters are
RULER's (synthetic.yaml). Where every task differs from RULER's generator, and why:

- The context is built in tokens: each sentence, needle or list item is tokenized on its
  own and the pieces concatenated, so a sample fills its length exactly in one pass
  instead of RULER's trial-and-error fit of the haystack size. A tokenizer that would
  merge tokens across two pieces tokenizes the joined text slightly differently.
- Words (keys, common words) are pseudo-words of three syllables, where RULER draws from
  the `wonderwords` English lists: lctrain ships no word list, and a 1M-token list needs
  more distinct words than those lists hold.
- Randomness comes from one numpy generator per sample (seed, task, length, index), so a
  sample is the same on every mesh; RULER's own seeds give other samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from lctrain.trainer.evaluation.retrieval import FILLER

NIAH_TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. "
                 "Make sure to memorize it. I will quiz you about the {type_needle_v} "
                 "afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for "
                 "{query} mentioned in the provided text? The special magic {type_needle_v} "
                 "for {query} mentioned in the provided text are")
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following "
               "text.\n\n{context}\nQuestion: Find all variables that are assigned the value "
               "{query} in the text above. Answer: According to the chain(s) of variable "
               "assignment in the text above, {num_v} variables are assgined the value {query}, "
               "they are:")
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than "
                "others. Memorize the ones that appear most often.\n{context}\nQuestion: What "
                "are the 10 most common words in the above list? Answer: The top 10 words that "
                "appear most often in the list are:")
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find "
                "the three most frequently appeared coded words. {context}\nQuestion: Do not "
                "provide any explanation. Please ignore the dots '....'. What are the three most "
                "frequently appeared words in the above coded text? Answer: According to the "
                "coded text above, the three most frequently appeared words are:")
# Needle depths (percent) RULER samples from for an essay haystack.
DEPTHS = np.round(np.linspace(0, 100, 40)).astype(int)
CONSONANTS, VOWELS = "bdfghklmnprstvz", "aeiou"

# Encodes texts to token ids (one list per text).
Encode = Callable[[list[str]], list[list[int]]]


class Text(Protocol):
    """What a context is built from: the model's tokenizer and the evaluation source."""

    def encode(self, texts: list[str]) -> list[list[int]]: ...

    def essay(self, count: int) -> np.ndarray: ...


@dataclass(frozen=True)
class Draft:
    """A sample before its context is built."""
    head: str                       # the template before the context
    tail: str                       # after the context, up to the answer
    outputs: list[str]              # the expected strings, in RULER's order
    context: Callable[[Text, int], list[int]]  # (text, budget) -> at most budget tokens
    tokens_to_generate: int


def split_template(template: str, **fields) -> tuple[str, str]:
    head, tail = template.split("{context}")
    return head.format(**fields), tail.format(**fields)


def pseudo_words(rng: np.random.Generator, count: int, syllables: int = 3) -> list[str]:
    """`count` distinct pronounceable words ("bakelo")."""
    words: dict[str, None] = {}
    while len(words) < count:
        consonant = rng.integers(0, len(CONSONANTS), (2 * count, syllables))
        vowel = rng.integers(0, len(VOWELS), (2 * count, syllables))
        for c_row, v_row in zip(consonant, vowel):
            words.setdefault("".join(CONSONANTS[c] + VOWELS[v] for c, v in zip(c_row, v_row)))
            if len(words) == count:
                break
    return list(words)


def needle_value(kind: str, rng: np.random.Generator) -> str:
    """RULER's needle keys and values: an adjective-noun pair (here two pseudo-words), a
    7-digit number or a uuid4."""
    if kind == "numbers":
        return str(rng.integers(1_000_000, 10_000_000))
    if kind == "words":
        return "-".join(pseudo_words(rng, 2))
    digits = rng.integers(0, 16, 32)
    digits[12], digits[16] = 4, 8 + digits[16] % 4  # version 4, variant 10xx
    text = "".join(f"{d:x}" for d in digits)
    return "-".join((text[:8], text[8:12], text[12:16], text[16:20], text[20:]))


def answer_layout(task: str, outputs: list[str]) -> list[tuple[str, bool]]:
    """The answer as the model would write it after the answer prefix, in pieces (True: an
    expected string, scored; False: a separator): cwe numbered as its example ("1. w 2. w"),
    vt and fwe separated by spaces, the needle tasks by commas."""
    if task == "cwe":
        return [piece for i, word in enumerate(outputs)
                for piece in ((f" {i + 1}.", False), (f" {word}", True))]
    between = " " if task in ("vt", "fwe") else ","
    return [piece for i, value in enumerate(outputs)
            for piece in ([(between, False)] if i and between != " " else []) + [(f" {value}", True)]]


def scores_any_answer(task: str) -> bool:
    """RULER's QA tasks (qa_1, qa_2; lm-eval's ruler_qa_squad, ruler_qa_hotpot) score
    string_match_part: any one of the expected answers counts."""
    return "qa" in task.split("_")


def answer_layouts(task: str, outputs: list[str]) -> list[list[tuple[str, bool]]]:
    """The answers scored, each after a copy of the prompt of its own: every expected
    answer alone for QA (any one counts, so each is forced on its own), else the one
    layout of all the strings."""
    if scores_any_answer(task):
        return [[(f" {answer}", True)] for answer in outputs]
    return [answer_layout(task, outputs)]


def units_up_to(encode: Encode, texts: list[str], budget: int) -> list[list[int]]:
    """Encoded texts, taken while they fit in `budget` tokens together."""
    units, used = [], 0
    for unit in encode(texts):
        if used + len(unit) > budget:
            break
        units.append(unit)
        used += len(unit)
    return units


def insert_at(units: list, needles: list, slots: list[int]) -> list:
    """The units (lists) joined, with needle i inserted before unit slots[i] (ascending)."""
    out: list = []
    needle = 0
    for index, unit in enumerate([*units, []]):
        while needle < len(needles) and slots[needle] == index:
            out += needles[needle]
            needle += 1
        out += unit
    return out


def niah(haystack: str, key_kind: str, value_kind: str, keys: int = 1, values: int = 1,
         queries: int = 1):
    """A needle-in-a-haystack task.

    As RULER: the needles ("One of the special magic numbers for K is: V.") are shuffled
    and placed at distinct random depths of the essay (RULER's 40 depths) or between
    random sentences of a noise or needle haystack; `queries` of the `keys` are asked,
    their values are the outputs. Differs: an essay needle goes in at a token, not a
    sentence boundary (the source is tokens, not text); the essay is the evaluation
    source, not Paul Graham's essays (and RULER's noise paragraph for synthetic data);
    distractor needles never reuse a queried key (RULER's could, by chance)."""
    keys = max(keys, queries)

    def draft(rng: np.random.Generator, length: int) -> Draft:
        key_texts = [needle_value(key_kind, rng) for _ in range(keys)]
        value_texts = [[needle_value(value_kind, rng) for _ in range(values)] for _ in key_texts]
        needles = [NEEDLE.format(type_needle_v=value_kind, key=k, value=v)
                   for k, vs in zip(key_texts, value_texts) for v in vs]
        needles = [needles[i] for i in rng.permutation(len(needles))]
        asked = rng.choice(keys, queries, replace=False)
        query = (", ".join(key_texts[i] for i in asked[:-1]) + ", and " + key_texts[asked[-1]]
                 if queries > 1 else key_texts[asked[0]])
        template, type_v = NIAH_TEMPLATE, value_kind
        if queries * values == 1:  # RULER's singular wording
            template = (template.replace("Some", "A").replace("are all", "is")
                        .replace("are", "is"))
            type_v = value_kind[:-1]
        head, tail = split_template(template, type_needle_v=type_v, query=query)
        if haystack != "essay":
            head = head.removesuffix("\n")  # its sentences start with one, as RULER's join
        outputs = [v for i in asked for v in value_texts[i]]

        def context(text: Text, budget: int) -> list[int]:
            needle_tokens = text.encode([("\n" if haystack != "essay" else " ") + n for n in needles])
            # Never below 0: needles longer than the budget are a sample too long (TooLong).
            room = max(budget - sum(map(len, needle_tokens)), 0)
            if haystack == "essay":
                tokens = list(text.essay(room))
                cuts = sorted(round(d / 100 * len(tokens)) for d in
                              rng.choice(DEPTHS, len(needles), replace=False))
                return insert_at([[t] for t in tokens], needle_tokens, cuts)
            if haystack == "noise":
                units = repeated(text.encode, "\n" + FILLER.strip(), room)
            else:
                units = units_up_to(text.encode, distractors(rng, room, key_kind, value_kind,
                                                        set(key_texts)), room)
            return insert_at(units, needle_tokens, random_slots(rng, len(units), len(needles)))

        return Draft(head, tail, outputs, context, 128)

    return draft


def repeated(encode: Encode, text: str, budget: int) -> list[list[int]]:
    """As many copies of the encoded text as fit in `budget` tokens."""
    [unit] = encode([text])
    return [unit] * (budget // len(unit))


def random_slots(rng: np.random.Generator, units: int, count: int) -> list[int]:
    """Where `count` insertions go among `units` units: distinct, ascending (RULER:
    random.sample of the haystack's sentences)."""
    return sorted(rng.choice(max(units, count), count, replace=False).tolist())


def distractors(rng: np.random.Generator, budget: int, key_kind: str, value_kind: str,
                taken: set[str]) -> list[str]:
    """RULER's needle haystack: needles of other keys, enough for `budget` tokens (a
    needle is longer than 8 tokens)."""
    sentences = []
    while len(sentences) * 8 < budget:
        key = needle_value(key_kind, rng)
        if key not in taken:
            sentences.append("\n" + NEEDLE.format(type_needle_v=value_kind, key=key,
                                                  value=needle_value(value_kind, rng)))
    return sentences


def variable_tracking(hops: int = 4, chains: int = 1):
    """vt: a chain "VAR A = 12345", "VAR B = VAR A ", ... of `hops` hops, in order, among
    RULER's noise sentences; the outputs are the chain's variables in order. As RULER, an
    example (3-letter variables) with its answer goes first; it has 5 noise sentences where
    RULER fits as many as 500 tokens hold (10 with tests/data/ruler_lm_eval's tokenizer),
    so its cost does not depend on the tokenizer."""
    noise = FILLER.strip() + "\n"

    def chain(rng: np.random.Generator, letters: int) -> tuple[list[str], list[str], str]:
        names: list[str] = []
        while len(names) < (hops + 1) * chains:
            name = "".join(chr(65 + c) for c in rng.integers(0, 26, letters))
            if name not in names:
                names.append(name)
        value = str(rng.integers(10_000, 100_000))
        lines = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} "
                                                 for j in range(hops)]
        return names[:hops + 1], lines, value

    def draft(rng: np.random.Generator, length: int) -> Draft:
        names, lines, value = chain(rng, 5)
        example_names, example_lines, example_value = chain(rng, 3)
        example = [[line] for line in [noise] * 5]
        example = insert_at(example, [[line] for line in example_lines],
                            random_slots(rng, 5, len(example_lines)))
        example_head, example_tail = split_template(VT_TEMPLATE, query=example_value,
                                                    num_v=hops + 1)
        head, tail = split_template(VT_TEMPLATE, query=value, num_v=hops + 1)
        head = (f"{example_head}{' '.join(example)}{example_tail} {' '.join(example_names)}"
                f"\n\n{head}")

        def context(text: Text, budget: int) -> list[int]:
            line_tokens = text.encode([" " + line for line in lines])
            units = repeated(text.encode, " " + noise, budget - sum(map(len, line_tokens)))
            return insert_at(units, line_tokens, random_slots(rng, len(units), len(lines)))

        return Draft(head, tail, names, context, 30)

    return draft


def most_that_fit(tokens: Callable[[int], int], budget: int, most: int) -> int:
    """The largest n <= most with tokens(n) <= budget (tokens grows with n); 0 if none."""
    low, high = 0, most
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if tokens(middle) <= budget else (low, middle - 1)
    return low


def word_list(rng: np.random.Generator, counts: np.ndarray) -> np.ndarray:
    """Word indices, index i counts[i] times, shuffled."""
    return rng.permutation(np.repeat(np.arange(len(counts)), counts))


def common_words(common: int = 10, common_repeats: int = 30, rare_repeats: int = 3):
    """cwe: `common` words `common_repeats` times each among words seen `rare_repeats`
    times, shuffled and numbered ("1. w 2. w ..."); the outputs are the common words, and
    the answer is laid out as the example's, numbered. As RULER: below 4,096 tokens the
    repeats are 6 and 1 (the example's 3 and 1 of 20 words, else 10 and 3 of 40), and the
    example list with its answer goes first. The number of rare words is the most that
    fit the budget (RULER: a search in steps of 10 words)."""

    def draft(rng: np.random.Generator, length: int) -> Draft:
        short = length < 4096
        repeats = (6, 1) if short else (common_repeats, rare_repeats)
        example_words = pseudo_words(rng, 20 if short else 40)
        example_counts = np.where(np.arange(len(example_words)) < common,
                                  *((3, 1) if short else (10, 3)))
        listed = " ".join(f"{i + 1}. {example_words[w]}"
                          for i, w in enumerate(word_list(rng, example_counts)))
        head, tail = split_template(CWE_TEMPLATE)
        example = " ".join(f"{i + 1}. {w}" for i, w in enumerate(example_words[:common]))
        words = pseudo_words(rng, common)

        def context(text: Text, budget: int) -> list[int]:
            # Every item is a number and a word, at least two tokens.
            rare = [w for w in pseudo_words(rng, budget // 2 + common) if w not in words]
            vocabulary = words + rare[:budget // 2]
            word_tokens = text.encode([f" {w}" for w in vocabulary])
            number_tokens = text.encode([f"{' ' if i else ''}{i + 1}." for i in range(budget // 2)])
            word_sums = np.cumsum([0, *map(len, word_tokens)])
            number_sums = np.cumsum([0, *map(len, number_tokens)])

            def size(rare_count: int) -> int:
                items = common * repeats[0] + rare_count * repeats[1]
                if items >= len(number_sums):
                    return budget + 1
                return int(number_sums[items] + repeats[0] * word_sums[common] + repeats[1]
                           * (word_sums[common + rare_count] - word_sums[common]))

            kept = most_that_fit(size, budget, len(vocabulary) - common)
            counts = np.where(np.arange(common + kept) < common, *repeats)
            return [t for i, w in enumerate(word_list(rng, counts))
                    for t in (*number_tokens[i], *word_tokens[w])]

        return Draft(f"{head}{listed}{tail} {example}\n{head}", tail, words, context, 120)

    return draft


def frequent_words(alpha: float = 2.0, letters: int = 6):
    """fwe: coded words (6 random letters) drawn with Zipf frequencies (word k of the
    vocabulary, length // 50 words, n * k^-alpha / zeta(alpha) times, the first being the
    dots '...' that the question says to ignore); the outputs are words 2 to 4, the most
    frequent, in frequency order. As RULER, but n is the most that fits the budget less the
    answer's 50 tokens (RULER fits the whole length and adds the 50 after)."""
    zeta = sum(k ** -alpha for k in range(1, 100_000)) + 100_000 ** (1 - alpha) / (alpha - 1)

    def draft(rng: np.random.Generator, length: int) -> Draft:
        vocabulary: list[str] = []
        while len(vocabulary) < max(length // 50, 4):
            word = "".join(chr(97 + c) for c in rng.integers(0, 26, letters))
            if word not in vocabulary:
                vocabulary.append(word)
        vocabulary[0] = "..."
        rank = np.arange(1, len(vocabulary) + 1)
        head, tail = split_template(FWE_TEMPLATE)
        head = head.removesuffix(" ")  # its words start with one

        def context(text: Text, budget: int) -> list[int]:
            word_tokens = text.encode([f" {w}" for w in vocabulary])
            sizes = np.array([len(t) for t in word_tokens])
            counts = lambda n: (n * rank ** -alpha / zeta).astype(int)
            total = most_that_fit(lambda n: int(counts(n) @ sizes), budget, budget)
            return [t for w in word_list(rng, counts(total)) for t in word_tokens[w]]

        outputs = vocabulary[1:4]
        return Draft(head, tail, outputs, context, 50)

    return draft


# eval.task names: RULER's 13 tasks (synthetic.yaml's parameters) but the two QA tasks,
# which are built from the file the user gives (ruler_qa.py).
TASKS = {
    "niah_single_1": niah("noise", "words", "numbers"),
    "niah_single_2": niah("essay", "words", "numbers"),
    "niah_single_3": niah("essay", "words", "uuids"),
    "niah_multikey_1": niah("essay", "words", "numbers", keys=4),
    "niah_multikey_2": niah("needle", "words", "numbers"),
    "niah_multikey_3": niah("needle", "uuids", "uuids"),
    "niah_multivalue": niah("essay", "words", "numbers", values=4),
    "niah_multiquery": niah("essay", "words", "numbers", queries=4),
    "vt": variable_tracking(),
    "cwe": common_words(),
    "fwe": frequent_words(),
}
