"""RULER's QA tasks (qa_1, qa_2): samples built from the frozen SQuAD and HotpotQA files
of tests/data (made-up paragraphs in those files' formats) as RULER's qa.py builds them;
string_match_part by hand; RULER's own QA samples read; the files' errors named."""

import json
from pathlib import Path

import numpy as np
import pytest

from lctrain.recipes import RecipeError, load_recipe
from lctrain.trainer.data.batches import decode_tokens
from lctrain.trainer.evaluation.ruler import (Scored, cell_score, check_eval_task, file_cells,
                                              generated_cells, skipped_tasks, task_names)

DATA = Path(__file__).parent / "data"
SQUAD, HOTPOTQA = DATA / "squad_tiny.json", DATA / "hotpotqa_tiny.json"
QA_HEAD = ("Answer the question based on the given documents. Only give me the answer and do "
           "not output any other words.\n\nThe following are given documents.\n\n")
QA_ANSWER_BUDGET = 32  # RULER's tokens_to_generate for qa


def qa_samples(task, length, qa_files=(f"eval.squad={SQUAD}", f"eval.hotpotqa={HOTPOTQA}")):
    """Four samples of `task` at `length` bytes: each a list of (prompt, [answer strings])
    alternatives."""
    recipe = load_recipe("tiny", [f"eval.task={task}", f"eval.seq_len={length}",
                                  "eval.lengths=1", "data.batch_size=4", *qa_files])
    [(_, _, samples)] = generated_cells(recipe.for_evaluation(), None, 0)
    return [[(decode_tokens(a.tokens[:a.strings[0][0]]),
              [decode_tokens(a.tokens[start:stop]) for start, stop in a.strings])
             for a in sample] for sample in samples]


def documents_of(prompt):
    """The prompt's documents in order, once their headers are checked: Document 1, 2, ..."""
    body = prompt[len(QA_HEAD):prompt.rindex("\n\nAnswer the question")].split("\n\n")
    headers, documents = zip(*(d.split(":\n", 1) for d in body))
    assert list(headers) == [f"Document {i}" for i in range(1, len(body) + 1)]
    return list(documents)


def test_qa_1_is_rulers_qa_from_the_squad_file():
    """The question's paragraph, then its article's, then the rest (repeated once the file
    fits), shuffled and numbered; filled to the length less the answer's 32 tokens; each
    distinct answer forced on its own; never the impossible question."""
    articles = [[p["context"] for p in a["paragraphs"]]
                for a in json.loads(SQUAD.read_text())["data"]]
    answerable = {qa["question"]: (p["context"], article, list(dict.fromkeys(
        answer["text"] for answer in qa["answers"])))
        for article, a in enumerate(json.loads(SQUAD.read_text())["data"])
        for p in a["paragraphs"] for qa in p["qas"] if not qa["is_impossible"]}
    assert len(answerable) == 4
    # The most one document takes with its header and separator.
    largest = max(len(f"Document 99:\n{p}\n\n") for article in articles for p in article)
    for length in (1024, 4096):
        for sample in qa_samples("qa_1", length):
            prompt = sample[0][0]
            paragraph, article, answers = answerable[prompt.split("Question: ")[-1][:-8]]
            assert prompt.endswith(" Answer:") and prompt.startswith(QA_HEAD)
            assert [alternative for _, alternative in sample] == [[f" {a}"] for a in answers]
            assert {alternative_prompt for alternative_prompt, _ in sample} == {prompt}
            documents = documents_of(prompt)
            assert paragraph in documents
            assert length - QA_ANSWER_BUDGET - largest < len(prompt) <= length - QA_ANSWER_BUDGET
            if length == 1024:  # 4 of the 5 paragraphs fit: the article's come first
                assert len(documents) == 4 and set(articles[article]) <= set(documents)
            else:  # the file cycles: each paragraph n // 5 or n // 5 + 1 times
                times = [documents.count(p) for a in articles for p in a]
                assert sum(times) == len(documents) and max(times) - min(times) <= 1
                assert min(times) == len(documents) // 5


def test_qa_2_holds_every_paragraph_of_its_question_or_says_what_they_take(tmp_path):
    """HotpotQA: all of the question's paragraphs (title, newline, sentences joined) are in
    every sample, as RULER's; when they cannot fit, the error gives the tokens they take,
    counted here by hand in bytes."""
    records = json.loads(HOTPOTQA.read_text())
    own = {r["question"]: ([f"{t}\n{''.join(s)}" for t, s in r["context"]], r["answer"])
           for r in records}
    for sample in qa_samples("qa_2", 1024):
        [(prompt, strings)] = sample
        paragraphs, answer = own[prompt.split("Question: ")[-1][:-8]]
        assert set(paragraphs) <= set(documents_of(prompt)) and strings == [f" {answer}"]
    one = tmp_path / "one.json"
    one.write_text(json.dumps(records[:1]))
    paragraphs, _ = own[records[0]["question"]]
    needed = sum(len(f"Document {i}:\n{p}") for i, p in enumerate(paragraphs, 1)) + 2 * 3
    tail = (f"\n\nAnswer the question based on the given documents. Only give me the answer and "
            f"do not output any other words.\n\nQuestion: {records[0]['question']} Answer:")
    budget = 512 - QA_ANSWER_BUDGET - len(QA_HEAD) - len(tail)
    with pytest.raises(RecipeError, match=rf"^eval.task qa_2 at 512 tokens: the question's own "
                                          rf"documents take {needed} tokens, more than the "
                                          rf"{budget} its template and answer budget leave; "
                                          rf"raise eval.seq_len or lower eval.lengths$"):
        qa_samples("qa_2", 512, [f"eval.hotpotqa={one}"])


def test_string_match_part_scores_a_sample_by_its_best_answer():
    """Three samples packed four alternatives to a row: a QA sample with answers missed and
    found scores 1, one with none found 0, a string_match_all sample with 3 of its 4
    strings found 0.75: (1 + 0 + 0.75) / 3 = 58.33%. Each string's loss-mask id marks the
    input that predicts its token (token p of a sample is p + 1)."""
    def alternative(strings):
        return Scored(np.arange(16) + 1, [(8 + 2 * i, 9 + 2 * i) for i in range(strings)])

    samples = [[alternative(1), alternative(1)], [alternative(1)] * 3, [alternative(4)]]
    found = iter([False, True, False, False, False, True, False, True, True])

    def found_in(batch, strings):
        for string in range(1, strings + 1):
            [[_, at]] = np.argwhere(batch.loss_mask == string)
            assert at % 16 in (7, 9, 11, 13) and batch.targets[0, at] == at % 16 + 2
        return np.array([next(found) for _ in range(strings)])

    score = cell_score(samples, found_in, seq_len=64, rows=1, length=16)
    assert score == pytest.approx(100 * (1 + 0 + 0.75) / 3)
    assert next(found, None) is None


def test_qa_files_missing_unreadable_or_of_another_format_are_named(tmp_path):
    from typer.testing import CliRunner

    from lctrain.cli.main import app

    missing = tmp_path / "dev-v2.0.json"
    with pytest.raises(RecipeError, match=rf"^recipe key 'eval.squad' = '{missing}': no such "
                                          rf"file \(looked for {missing}\); give SQuAD v2's dev "
                                          r"json \(dev-v2.0.json\), as RULER's "):
        load_recipe("tiny", [f"eval.squad={missing}"])
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    cases = [(["eval.task=qa_1", f"eval.squad={broken}"], "eval.squad", broken, "not JSON"),
             (["eval.task=qa_1", f"eval.squad={HOTPOTQA}"], "eval.squad", HOTPOTQA,
              r"not in its format \(TypeError"),
             (["eval.task=qa_2", f"eval.hotpotqa={SQUAD}"], "eval.hotpotqa", SQUAD,
              r"not in its format \(TypeError")]
    for sets, key, path, why in cases:
        with pytest.raises(RecipeError, match=rf"^recipe key '{key}' = '{path}': {why}"):
            check_eval_task(load_recipe("tiny", [*sets, "eval.seq_len=1024", "eval.lengths=1"]))
    with pytest.raises(RecipeError, match=r"^recipe key 'eval.task' = 'qa_2': RULER's qa_2 is "
                                          r"built from a local file; set eval.hotpotqa to "
                                          r"HotpotQA's dev distractor json"):
        check_eval_task(load_recipe("tiny", ["eval.task=qa_2"]))
    # Before anything compiles: one line, exit 2.
    result = CliRunner().invoke(app, ["eval", "--run-dir", str(tmp_path), "--set",
                                      "eval.task=qa_1", "--set", f"eval.squad={broken}"])
    assert result.exit_code == 2
    assert f"recipe key 'eval.squad' = '{broken}': not JSON; give SQuAD v2's dev json" in \
        " ".join(result.output.split())
    group = load_recipe("tiny", ["eval.task=ruler", f"eval.squad={SQUAD}"]).for_evaluation()
    assert task_names(group)[-1] == "qa_1" and "qa_2" not in task_names(group)
    assert skipped_tasks(group) == {"qa_2": "needs eval.hotpotqa: HotpotQA's dev distractor "
                                            "json (hotpot_dev_distractor_v1.json)"}


def test_rulers_own_qa_samples_are_read_with_their_answer_prefix(tmp_path):
    """RULER's qa.py writes <task>/validation.jsonl, the answer prefix in a field of its
    own; each answer is scored after its own copy of the prompt (string_match_part)."""
    record = {"index": 0, "input": "Document 1:\nThe tower was built in 1851.\n\nQuestion: "
                                   "When was the tower built?",
              "outputs": ["1851", "in 1851"], "length": 120, "answer_prefix": " Answer:"}
    path = tmp_path / "qa_1" / "validation.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps(record) + "\n")
    recipe = load_recipe("tiny", [f"eval.samples={path}", "eval.seq_len=128"])
    [(task, length, [sample])] = file_cells(recipe.for_evaluation())
    assert (task, length, len(sample)) == ("qa_1", 120, 2)
    prompt = record["input"] + " Answer:"
    for alternative, answer in zip(sample, [" 1851", " in 1851"]):
        [(start, stop)] = alternative.strings
        assert start == len(prompt) and decode_tokens(alternative.tokens[:start]) == prompt
        assert decode_tokens(alternative.tokens[start:stop]) == answer
