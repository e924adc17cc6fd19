"""RULER on the training mesh (eval.task ruler or one of its tasks; eval.samples): samples
built to each length (ruler_tasks.py, ruler_qa.py) or read from a RULER / lm-eval jsonl
file, packed into the evaluated sequence, scored teacher-forced, summed up by length.

Scoring is RULER's, teacher-forced: the sample's prompt is followed by its answer laid
out as the model would write it (ruler_tasks.answer_layout, RULER's output order), and
an expected string counts as found when every one of its tokens is the argmax given the
gold tokens before it. string_match_all (every task but QA): a sample scores the share of
its strings found. string_match_part (QA): each expected answer follows a copy of the
prompt of its own, and the sample scores 1 when any is found. A task at a length is the
mean over its samples, in percent. One forward pass per batch: samples of one length
share a row, each its own segment (docs/evaluation.md says where this can differ from
greedy generation).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lctrain.recipes.schema import QA_FILES, RULER_TASKS, Recipe, RecipeError
from lctrain.trainer.data.batches import Batch, DataSource
from lctrain.trainer.evaluation.retrieval import FILLER, Pieces, check_retrieval
from lctrain.trainer.evaluation.ruler_qa import DoesNotFit, load_qa, qa, qa_path
from lctrain.trainer.evaluation.ruler_tasks import TASKS, Draft, answer_layouts

GROUP = "ruler"
assert (*TASKS, *QA_FILES) == RULER_TASKS, \
    "recipes/schema.py's RULER_TASKS must name ruler_tasks.TASKS and the QA tasks"
SAMPLE_FIELDS = ("input", "outputs", "length")
# RULER's generators leave the answer prefix out of `input` in a field of its own, which
# its prediction script appends as it is; lm-eval's gen_prefix goes after a space.
PREFIX_FIELDS = (("answer_prefix", ""), ("gen_prefix", " "))


@dataclass(frozen=True)
class Scored:
    """A sample as scored: its tokens (prompt, then answer) and where each expected string
    lies in them ([start, stop))."""
    tokens: np.ndarray
    strings: list[tuple[int, int]]


# A sample: its alternatives, each scored on its own, the best counting (QA: one per
# expected answer; every other task: one, holding all its strings).
Sample = list[Scored]


def is_ruler(recipe: Recipe) -> bool:
    return bool(recipe.eval.samples) or recipe.eval.task in (GROUP, *RULER_TASKS)


def task_names(recipe: Recipe) -> list[str]:
    """The tasks scored: one, or the group's, less the QA tasks without their file."""
    if recipe.eval.task != GROUP:
        return [recipe.eval.task]
    return [task for task in RULER_TASKS if task not in skipped_tasks(recipe)]


def skipped_tasks(recipe: Recipe) -> dict[str, str]:
    """Tasks of the group that are not scored, and why."""
    if recipe.eval.task != GROUP or recipe.eval.samples:
        return {}
    return {task: f"needs eval.{key}: {dataset}" for task, (key, dataset) in QA_FILES.items()
            if qa_path(task, recipe) is None}


def task_draft(task: str, recipe: Recipe):
    """(rng, length) -> Draft for `task`; a QA task reads its file (RecipeError if it
    cannot)."""
    if task not in QA_FILES:
        return TASKS[task]
    if qa_path(task, recipe) is None:
        key, dataset = QA_FILES[task]
        raise RecipeError(f"recipe key 'eval.task' = {task!r}: RULER's {task} is built from "
                          f"a local file; set eval.{key} to {dataset}")
    return qa(load_qa(task, recipe))


def ruler_lengths(recipe: Recipe) -> list[int]:
    """eval.lengths lengths, halving from the evaluated sequence (RULER's powers of two
    when eval.seq_len is one: 4K ... 128K for eval.lengths 6 at 131,072)."""
    seq_len = recipe.data.seq_len
    return sorted({seq_len >> k for k in range(recipe.eval.lengths) if seq_len >> k})


class SampleText:
    """The model's tokenizer (or bytes) and the evaluation source's text, for one sample."""

    def __init__(self, pieces: Pieces, source: DataSource | None, row: int):
        self.pieces, self.source, self.row = pieces, source, row

    def encode(self, texts: list[str]) -> list[list[int]]:
        tokenizer = self.pieces.tokenizer
        encoded = ([e.ids for e in tokenizer.tokenizer.encode_batch(texts,
                                                                    add_special_tokens=False)]
                   if tokenizer else [self.pieces.encode(text) for text in texts])
        largest = max((max(ids) for ids in encoded if ids), default=0)
        if largest >= self.pieces.vocab:
            raise RecipeError(f"model.vocab: {self.pieces.vocab} ids cannot hold RULER's text "
                              f"(token id {largest}); give the model's tokenizer as "
                              f"data.tokenizer")
        return encoded

    def essay(self, count: int) -> np.ndarray:
        """The evaluation source's own tokens; RULER's noise paragraph for synthetic data."""
        if self.source is not None:
            return self.pieces.filler(None, count, self.source, self.row)
        return np.resize(np.asarray(self.encode([FILLER])[0]), count)


class TooLong(RecipeError):
    """A sample that cannot fit the length it is meant for (its template and answer
    budget, or the whole sample, are longer): the group skips that task at that length,
    a task on its own stops."""


def assemble(prompt: list[int], answer: list[tuple[list[int], bool]], length: int,
             where: str, fix: str) -> Scored:
    """Prompt and answer as one sample; an error if longer than the length it is for."""
    tokens, strings = list(prompt), []
    for piece, scored in answer:
        if scored:
            strings.append((len(tokens), len(tokens) + len(piece)))
        tokens += piece
    if len(tokens) > length:
        raise TooLong(f"{where}: the sample takes {len(tokens):,} tokens, more than the "
                          f"{length:,} it is meant for; {fix}")
    return Scored(np.asarray(tokens, np.int64), strings)


def encoded_answers(task: str, outputs: list[str], text: SampleText):
    """Each alternative answer (ruler_tasks.answer_layouts) as (tokens, scored) pieces."""
    for layout in answer_layouts(task, outputs):
        yield list(zip(text.encode([piece for piece, _ in layout]),
                       [scored for _, scored in layout]))


def build_sample(task: str, draft: Draft, text: SampleText, length: int) -> Sample:
    """One sample of `task` filling `length` tokens less the task's answer budget."""
    head, tail = text.encode([draft.head, draft.tail])
    head = [*text.pieces.bos, *head]
    budget = length - draft.tokens_to_generate - len(head) - len(tail)
    where = f"eval.task {task} at {length:,} tokens"
    fix = "raise eval.seq_len or lower eval.lengths"
    if budget < 0:
        raise TooLong(f"{where}: its template and answer budget take "
                          f"{length - budget:,} tokens; {fix}")
    try:
        prompt = [*head, *draft.context(text, budget), *tail]
    except DoesNotFit as error:
        raise TooLong(f"{where}: the question's own documents take {error.needed:,} "
                          f"tokens, more than the {budget:,} its template and answer budget "
                          f"leave; {fix}") from None
    return [assemble(prompt, answer, length, where, fix)
            for answer in encoded_answers(task, draft.outputs, text)]


def generated_cells(recipe: Recipe, source: DataSource | None, seed: int,
                    unfit: dict[str, dict[int, str]] | None = None):
    """(task, length, samples) for every task and length its samples fit (the group
    skips the others: `unfit`, group_skips' when not given): as many samples as fill one
    batch (data.batch_size rows of eval.seq_len // length samples each)."""
    pieces = Pieces(recipe)
    seq_len, rows = recipe.data.seq_len, recipe.data.batch_size
    unfit = group_skips(recipe) if unfit is None else unfit
    for task in task_names(recipe):
        make_draft = task_draft(task, recipe)
        for length in ruler_lengths(recipe):
            if length in unfit.get(task, {}):
                continue
            count = rows * (seq_len // length)
            task_index = RULER_TASKS.index(task)
            samples = []
            for index in range(count):
                rng = np.random.default_rng([seed, task_index, length, index])
                samples.append(build_sample(task, make_draft(rng, length),
                                            SampleText(pieces, source, index % rows), length))
            yield task, length, samples


def file_cells(recipe: Recipe):
    """(task, length, samples) from eval.samples, grouped by task and by the length each
    sample is meant for (lm-eval's max_length, else RULER's length)."""
    path = Path(recipe.eval.samples)
    text = SampleText(Pieces(recipe), None, 0)
    cells: dict[tuple[str, int], list[Sample]] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = read_record(line, f"eval.samples: {path} line {number}")
        task = record.get("task") or file_task(path)
        length = int(record.get("max_length") or record["length"])
        where = f"eval.samples: {path} line {number} ({task})"
        if length > recipe.data.seq_len:
            raise RecipeError(f"{where}: meant for {length:,} tokens, longer than eval.seq_len "
                              f"{recipe.data.seq_len:,}; set eval.seq_len >= {length}")
        [prompt] = text.encode([record["input"] + answer_prefix(record)])
        cells.setdefault((task, length), []).append([
            assemble([*text.pieces.bos, *prompt], answer, length, where,
                     "make the samples with the model's tokenizer (data.tokenizer)")
            for answer in encoded_answers(task, list(record["outputs"]), text)])
    for (task, length), samples in sorted(cells.items(), key=lambda cell: cell[0][::-1]):
        yield task, length, samples


def file_task(path: Path) -> str:
    """The task of a file's samples without a task field: the file's name, or its
    folder's for RULER's <task>/validation.jsonl."""
    return path.parent.name if path.stem in ("validation", "test") else path.stem


def answer_prefix(record: dict) -> str:
    """What follows the input before the answer: RULER's answer_prefix or lm-eval's
    gen_prefix."""
    for field, joint in PREFIX_FIELDS:
        if record.get(field):
            return joint + record[field].strip() if joint else record[field]
    return ""


def read_record(line: str, where: str) -> dict:
    """One jsonl line with RULER's fields."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise RecipeError(f"{where}: not JSON ({error.msg}); give RULER's or lm-eval's "
                          f"samples, one JSON object a line") from None
    missing = [field for field in SAMPLE_FIELDS if field not in record]
    if missing:
        raise RecipeError(f"{where}: no {', '.join(missing)}; a sample needs the fields "
                          f"{', '.join(SAMPLE_FIELDS)} (RULER's and lm-eval's)")
    return record


def ruler_cells(recipe: Recipe, source: DataSource | None, seed: int,
                unfit: dict[str, dict[int, str]]):
    """(how many cells, the cells) but those `unfit` (group_skips): generated ones one at
    a time, as a cell at 1M tokens holds a batch's worth of samples."""
    if recipe.eval.samples:
        cells = list(file_cells(recipe))
        return len(cells), iter(cells)
    count = len(task_names(recipe)) * len(ruler_lengths(recipe))
    count -= sum(map(len, unfit.values()))
    return count, generated_cells(recipe, source, seed, unfit)


def group_skips(recipe: Recipe) -> dict[str, dict[int, str]]:
    """What the generated `ruler` group skips (unfit_lengths); a task on its own, or
    eval.samples, skips nothing (check_ruler stops an unfit one before it compiles)."""
    generated_group = recipe.eval.task == GROUP and not recipe.eval.samples
    return unfit_lengths(recipe) if generated_group else {}


def check_ruler(recipe: Recipe) -> None:
    """RecipeError unless every sample fits the length it is meant for: each task's sample
    at each length, or every sample of eval.samples (before anything compiles). The group
    skips a task at the lengths it cannot fit, and stops only when none fits anywhere."""
    if recipe.eval.samples:
        for _ in file_cells(recipe):
            pass
        return
    unfit = unfit_lengths(recipe)
    cells = len(task_names(recipe)) * len(ruler_lengths(recipe))
    if unfit and (recipe.eval.task != GROUP or sum(map(len, unfit.values())) == cells):
        raise TooLong(next(iter(next(iter(unfit.values())).values())))


def unfit_lengths(recipe: Recipe) -> dict[str, dict[int, str]]:
    """Per task, the lengths its samples cannot fit, and why: one sample (seed 0) a task
    and length, as RULER's templates differ in size (byte tokens: vt, cwe and fwe need a
    few thousand; cwe's template grows at 4,096, where RULER's counts change)."""
    pieces, unfit = Pieces(recipe), {}
    for task in task_names(recipe):
        make_draft = task_draft(task, recipe)  # a QA file that cannot be read stops here
        for length in ruler_lengths(recipe):
            try:
                build_sample(task, make_draft(np.random.default_rng(0), length),
                             SampleText(pieces, None, 0), length)
            except TooLong as error:
                unfit.setdefault(task, {})[length] = str(error)
    return unfit


def check_eval_task(recipe: Recipe) -> None:
    """RecipeError unless eval.task's samples (RULER's or the retrieval grid's) fit the
    lengths they are for: phase 2 of `lctrain eval`'s checks, and of a run's that evaluates
    during training, before anything compiles."""
    evaluated = recipe.for_evaluation()
    if is_ruler(evaluated):
        check_ruler(evaluated)
    else:
        check_retrieval(recipe)


def packed_batches(samples: list[Scored], seq_len: int, rows: int, slot: int):
    """(Batch, owners): the samples `seq_len // slot` to a row, each in a slot of `slot`
    tokens that is its own segment (the tokens after a sample, in its slot, come later
    and causal attention never shows them to it). The loss mask holds each expected
    string's id (1, 2, ...) on the inputs that predict its tokens; owners[id - 1] is the
    string's sample, by its index in `samples`."""
    per_row = seq_len // slot
    for first in range(0, len(samples), rows * per_row):
        windows = np.zeros((rows, seq_len + 1), np.int64)
        slots = np.minimum(np.arange(seq_len) // slot, per_row)
        positions = np.broadcast_to(np.arange(seq_len) - slots * slot, (rows, seq_len))
        ids, owners = np.zeros((rows, seq_len), np.float32), []
        for index, sample in enumerate(samples[first:first + rows * per_row]):
            row, place = divmod(index, per_row)
            start = place * slot
            windows[row, start:start + len(sample.tokens)] = sample.tokens
            for begin, end in sample.strings:
                owners.append(first + index)
                ids[row, start + begin - 1:start + end - 1] = len(owners)
        yield Batch(windows[:, :-1].astype(np.int32), windows[:, 1:].astype(np.int32),
                    positions.astype(np.int32),
                    np.broadcast_to(slots + 1, (rows, seq_len)).astype(np.int32), ids), owners


def sample_scores(found: np.ndarray, owners: list[int], count: int) -> np.ndarray:
    """Per sample, the share of its expected strings found (string_match_all)."""
    strings = np.bincount(owners, minlength=count)
    return np.bincount(owners, found.astype(float), minlength=count) / np.maximum(strings, 1)


def cell_score(samples: list[Sample], found_in, seq_len: int, rows: int, length: int) -> float:
    """A task's score (%) at one length: per sample its best alternative's share of
    strings found, averaged. found_in(batch, strings) says whether each of the batch's
    strings (loss-mask ids 1..strings) was found."""
    alternatives = [alternative for sample in samples for alternative in sample]
    sample_of = np.repeat(np.arange(len(samples)), [len(sample) for sample in samples])
    shares = np.zeros(len(alternatives))
    for batch, owners in packed_batches(alternatives, seq_len, rows, length):
        shares += sample_scores(found_in(batch, len(owners)), owners, len(alternatives))
    best = np.zeros(len(samples))
    np.maximum.at(best, sample_of, shares)
    return 100 * float(best.mean())


def effective_length(lengths: list[int], averages: list[float | None],
                     threshold: float) -> int | None:
    """The longest length whose average, and every shorter length's, is above the
    threshold (RULER's effective context length); None when the shortest is not."""
    effective = None
    for length, average in sorted(zip(lengths, averages)):
        if average is None or average <= threshold:
            break
        effective = length
    return effective


def ruler_summary(scores: dict[str, dict[int, tuple[float, int]]], recipe: Recipe,
                  unfit: dict[str, dict[int, str]] | None = None) -> dict:
    """ruler.json: score (%) and samples per task and length, the average per length over
    the tasks scored there, the effective length at eval.threshold, and what was skipped
    and why (QA without its file; `unfit`: unfit_lengths)."""
    lengths = sorted({length for by_length in scores.values() for length in by_length})
    table = {task: [by_length.get(length, (None, 0))[0] for length in lengths]
             for task, by_length in scores.items()}
    averages = []
    for column in zip(*table.values()):
        present = [score for score in column if score is not None]
        averages.append(float(np.mean(present)) if present else None)
    threshold = recipe.eval.threshold
    return {"tasks": list(scores), "lengths": lengths, "scores": table,
            "samples": {task: [by_length.get(length, (None, 0))[1] for length in lengths]
                        for task, by_length in scores.items()},
            "average": averages, "threshold": threshold,
            "effective_length": effective_length(lengths, averages, threshold),
            "skipped": {**skipped_tasks(recipe), **unfit_reasons(unfit or {})},
            "source": recipe.eval.samples or "lctrain's generator"}


def unfit_reasons(unfit: dict[str, dict[int, str]]) -> dict[str, str]:
    """Per task, why it was skipped where (the first length's message stands for all)."""
    return {task: f"at {', '.join(f'{length:,}' for length in by_length)} tokens: "
                  f"{next(iter(by_length.values())).split(': ', 1)[-1]}"
            for task, by_length in unfit.items()}
