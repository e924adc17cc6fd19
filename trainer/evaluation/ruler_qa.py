"""RULER's QA tasks: qa_1 from a local SQuAD file (eval.squad), qa_2 from a local HotpotQA
file (eval.hotpotqa), as NVIDIA/RULER's scripts/data/synthetic/qa.py builds them.

A sample asks one question of the file after a haystack of its documents ("Document i:"
and a paragraph, blank lines between): the question's own documents (SQuAD: its paragraph;
HotpotQA: all ten of its paragraphs, the two gold and eight distractors) always, then as
many others as fit, those of the same SQuAD article first, then the rest of the file at
random; when the whole file fits, it repeats. The documents are shuffled and numbered. The
expected strings are the question's answers, any one of which counts (RULER's
string_match_part). Where lctrain differs from RULER's generator, and why:

- The haystack is filled in tokens (each "Document i:" header, paragraph and separator
  tokenized on its own), as the other tasks are, instead of RULER's binary search over the
  number of documents.
- Each sample draws its question at random from its own generator (seed, task, length,
  index), where RULER walks the questions in file order: a sample is then the same
  whatever else is generated, on every mesh.
- A file that repeats cycles the candidates (the question's documents first), not the
  file's sorted documents, so the question's documents are always in the haystack.
- The answers are deduplicated (SQuAD repeats one answer per annotator): each distinct
  answer is scored once, teacher-forced, each in a copy of the prompt of its own.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lctrain.recipes.schema import QA_FILES, Recipe, RecipeError
from lctrain.trainer.evaluation.ruler_tasks import Draft, Text, split_template

QA_TEMPLATE = ("Answer the question based on the given documents. Only give me the answer and "
               "do not output any other words.\n\nThe following are given documents.\n\n"
               "{context}\n\nAnswer the question based on the given documents. Only give me "
               "the answer and do not output any other words.\n\nQuestion: {query} Answer:")
DOCUMENT_HEADER = "Document {i}:\n"
SEPARATOR = "\n\n"
# Documents encoded at a time while the haystack grows (a 1M-token haystack holds thousands).
ENCODE_CHUNK = 256


@dataclass(frozen=True)
class Question:
    query: str
    answers: list[str]       # distinct, in the file's order
    documents: list[int]     # always in the haystack
    related: list[int]       # preferred distractors (SQuAD: the same article's paragraphs)


@dataclass(frozen=True)
class QaFile:
    questions: list[Question]
    documents: list[str]


class DoesNotFit(Exception):
    """The question's own documents take more tokens than the sample has room for."""

    def __init__(self, needed: int):
        super().__init__(needed)
        self.needed = needed


def distinct(texts) -> list[str]:
    return list(dict.fromkeys(text.strip() for text in texts if text.strip()))


def read_squad(data: dict) -> QaFile:
    """SQuAD v2 (or v1.1): every answerable question, its paragraph, and its article's
    other paragraphs as the preferred distractors."""
    index: dict[str, int] = {}
    questions = []
    for article in data["data"]:
        paragraphs = [index.setdefault(p["context"], len(index)) for p in article["paragraphs"]]
        for paragraph, own in zip(article["paragraphs"], paragraphs):
            for qa in paragraph["qas"]:
                answers = distinct(answer["text"] for answer in qa["answers"])
                if answers and not qa.get("is_impossible", False):
                    questions.append(Question(qa["question"], answers, [own],
                                              [p for p in dict.fromkeys(paragraphs) if p != own]))
    return QaFile(questions, list(index))


def read_hotpotqa(data: list) -> QaFile:
    """HotpotQA (dev distractor): every question with its ten paragraphs, each its title, a
    newline and its sentences joined as RULER joins them."""
    index: dict[str, int] = {}
    questions = []
    for record in data:
        own = [index.setdefault(f"{title}\n{''.join(sentences)}", len(index))
               for title, sentences in record["context"]]
        answers = distinct([record["answer"]])
        if answers:
            questions.append(Question(record["question"], answers, own, []))
    return QaFile(questions, list(index))


READERS = {"qa_1": read_squad, "qa_2": read_hotpotqa}


def qa_path(task: str, recipe: Recipe) -> str | None:
    """The file eval.squad or eval.hotpotqa names for the task; None when not given."""
    return getattr(recipe.eval, QA_FILES[task][0])


def load_qa(task: str, recipe: Recipe) -> QaFile:
    """The task's file, read once per path and modification time (HotpotQA's is 46 MB);
    RecipeError naming the key, the path and the file to give when it cannot be read."""
    path = Path(qa_path(task, recipe))
    try:
        return _read_qa(task, str(path.absolute()), path.stat().st_mtime_ns)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        key, dataset = QA_FILES[task]
        why = ("not JSON" if isinstance(error, (json.JSONDecodeError, UnicodeDecodeError))
               else f"unreadable ({error.strerror})" if isinstance(error, OSError)
               else "no answerable question" if isinstance(error, RecipeError)
               else f"not in its format ({type(error).__name__}: {error})")
        raise RecipeError(f"recipe key 'eval.{key}' = {str(path)!r}: {why}; give {dataset}, "
                          f"which RULER's {task} is built from") from None


@functools.lru_cache(maxsize=2)
def _read_qa(task: str, path: str, mtime_ns: int) -> QaFile:
    with open(path, encoding="utf-8") as file:
        qa_file = READERS[task](json.load(file))
    if not qa_file.questions:
        raise RecipeError("no answerable question")
    return qa_file


def candidate_order(rng: np.random.Generator, question: Question, documents: int) -> np.ndarray:
    """The documents in the order they join the haystack: the question's own, its related
    ones at random, then every other at random."""
    first = [*question.documents, *rng.permutation(question.related).astype(int).tolist()]
    rest = np.setdiff1d(np.arange(documents), first)
    return np.concatenate([np.asarray(first, np.int64), rng.permutation(rest)])


def fitting_documents(text: Text, documents: list[str], order: np.ndarray,
                      budget: int) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """(documents, headers, separator) in tokens: the documents of `order` (cycled) that
    fit in `budget` tokens with the headers "Document 1:" ... and a separator between two."""
    [separator] = text.encode([SEPARATOR])
    encoded: dict[int, list[int]] = {}
    chosen: list[list[int]] = []
    headers: list[list[int]] = []
    used = 0
    while True:
        start = len(chosen)
        chunk = [int(order[(start + k) % len(order)]) for k in range(ENCODE_CHUNK)]
        new = [d for d in dict.fromkeys(chunk) if d not in encoded]
        encoded.update(zip(new, text.encode([documents[d] for d in new])))
        chunk_headers = text.encode([DOCUMENT_HEADER.format(i=start + k + 1)
                                     for k in range(ENCODE_CHUNK)])
        for document, header in zip(chunk, chunk_headers):
            size = len(header) + len(encoded[document]) + (len(separator) if chosen else 0)
            if used + size > budget:
                return chosen, headers, separator
            used += size
            chosen.append(encoded[document])
            headers.append(header)


def own_documents_size(text: Text, qa_file: QaFile, question: Question) -> int:
    """Tokens the question's own documents take with their headers and separators."""
    count = len(question.documents)
    *pieces, separator = text.encode([*(DOCUMENT_HEADER.format(i=i + 1) for i in range(count)),
                                      *(qa_file.documents[d] for d in question.documents),
                                      SEPARATOR])
    return sum(map(len, pieces)) + (count - 1) * len(separator)


def qa(qa_file: QaFile):
    """qa_1 / qa_2 as RULER's qa.py builds them (see the module's docstring)."""

    def draft(rng: np.random.Generator, length: int) -> Draft:
        question = qa_file.questions[rng.integers(len(qa_file.questions))]
        head, tail = split_template(QA_TEMPLATE, query=question.query)

        def context(text: Text, budget: int) -> list[int]:
            order = candidate_order(rng, question, len(qa_file.documents))
            chosen, headers, separator = fitting_documents(text, qa_file.documents, order,
                                                           budget)
            if len(chosen) < len(question.documents):
                raise DoesNotFit(own_documents_size(text, qa_file, question))
            tokens: list[int] = []
            for position, shuffled in enumerate(rng.permutation(len(chosen))):
                tokens += [*(separator if position else []), *headers[position],
                           *chosen[shuffled]]
            return tokens

        return Draft(head, tail, question.answers, context, 32)

    return draft
