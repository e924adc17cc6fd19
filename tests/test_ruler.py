"""RULER (eval.task ruler, eval.samples): samples of RULER's shape, the same for a seed;
QA built from the frozen SQuAD and HotpotQA files of tests/data (made-up paragraphs in
those files' formats) and scored string_match_part; lm-eval's and RULER's samples read;
the effective length; and, on the copy-task model, the scores a copier must get, the same
under every context-parallel strategy as on one device and logged during training."""

import io
import json
from pathlib import Path

import numpy as np
import pytest

from lctrain.recipes import RecipeError, load_recipe
from lctrain.trainer.data.batches import decode_tokens
from lctrain.trainer.evaluation.ruler import (Scored, cell_score, check_eval_task,
                                              effective_length, file_cells, generated_cells,
                                              ruler_summary, skipped_tasks, task_names)
from lctrain.trainer.evaluation.ruler_tasks import TASKS

# Byte-level text (ASCII fits the tiny model's 128 ids): 8,192 bytes hold every task.
GENERATED = ["eval.task=ruler", "eval.seq_len=8192", "eval.lengths=1", "data.batch_size=1"]
NEEDLE = "One of the special magic"


def generated(seed=0):
    recipe = load_recipe("tiny", GENERATED).for_evaluation()
    # Each sample's one alternative (QA's are the answers: not in this group without files).
    return {task: samples[0][0] for task, _, samples in generated_cells(recipe, None, seed)}


def test_generated_samples_have_rulers_shape_and_depend_only_on_the_seed():
    samples = generated()
    assert list(samples) == list(TASKS)
    answer_budget = {"vt": 30, "cwe": 120, "fwe": 50}
    for task, sample in samples.items():
        text = decode_tokens(sample.tokens)
        strings = [decode_tokens(sample.tokens[a:b]).strip() for a, b in sample.strings]
        prompt = decode_tokens(sample.tokens[:sample.strings[0][0]])
        # Filled to the length less the answer budget, as RULER fits its haystack.
        budget = 8192 - answer_budget.get(task, 128)
        assert budget - 100 <= sample.strings[0][0] <= budget, task
        assert all(string in prompt for string in strings), task
        if task.startswith("niah"):
            needles = {"niah_multikey_1": 4, "niah_multivalue": 4, "niah_multiquery": 4}
            count = prompt.count(NEEDLE)
            if task in ("niah_multikey_2", "niah_multikey_3"):  # a haystack of needles
                assert count > 50
            else:
                assert count == needles.get(task, 1), (task, count)
            assert len(strings) == (4 if task in ("niah_multivalue", "niah_multiquery") else 1)
            single = len(strings) == 1
            assert text.startswith("A special magic" if single else "Some special magic")
            kind = "uuid" if task in ("niah_single_3", "niah_multikey_3") else "number"
            assert f"The special magic {kind}{'' if single else 's'} for" in prompt
    vt = samples["vt"]
    names = [decode_tokens(vt.tokens[a:b]).strip() for a, b in vt.strings]
    vt_text = decode_tokens(vt.tokens)
    # The chain, in order: VAR B = VAR A, ... after the example.
    chain = [vt_text.rindex(f"VAR {b} = VAR {a}") for a, b in zip(names, names[1:])]
    assert len(names) == 5 and chain == sorted(chain)
    cwe_text = decode_tokens(samples["cwe"].tokens)
    listed = cwe_text[cwe_text.rindex("Memorize the ones"):cwe_text.rindex("Question")].split()
    counts = {word: listed.count(word) for word in set(listed) if word.isalpha()}
    words = [decode_tokens(samples["cwe"].tokens[a:b]).strip() for a, b in samples["cwe"].strings]
    assert sorted(counts.values())[-10:] == [30] * 10 and {counts[w] for w in words} == {30}
    assert set(counts.values()) - {30} <= {3} or set(counts.values()) - {30} <= {1, 3}
    fwe_text = decode_tokens(samples["fwe"].tokens).split("Question")[0].split()
    top = [decode_tokens(samples["fwe"].tokens[a:b]).strip() for a, b in samples["fwe"].strings]
    frequencies = sorted({w: fwe_text.count(w) for w in set(fwe_text)}.items(),
                         key=lambda item: -item[1])
    assert [w for w, _ in frequencies[1:4]] == top and frequencies[0][0] == "..."

    again, other = generated(0), generated(1)
    for task in TASKS:
        np.testing.assert_array_equal(again[task].tokens, samples[task].tokens)
        assert not np.array_equal(other[task].tokens[:len(samples[task].tokens)],
                                  samples[task].tokens[:len(other[task].tokens)])


# ------------------------------------------------------------------------------ QA ----

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
    assert [d.split(":\n", 1)[0] for d in body] == [f"Document {i}" for i in range(1, len(body) + 1)]
    return [d.split(":\n", 1)[1] for d in body]


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
    # A document, header and separator take at most 12 + 151 + 2 bytes.
    largest = max(len(f"Document 9:\n{p}\n\n") for article in articles for p in article)
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


def test_a_task_longer_than_its_length_is_an_error():
    recipe = load_recipe("tiny", ["eval.task=cwe", "eval.seq_len=4096", "eval.lengths=1"])
    with pytest.raises(RecipeError, match=r"eval.task cwe at 4,096 tokens: the sample takes "
                                          r"[\d,]+ tokens, more than the 4,096"):
        next(generated_cells(recipe.for_evaluation(), None, 0))


def test_effective_length_by_hand():
    """RULER's definition: the longest length whose average and every shorter length's
    are above the threshold. At 32K the average is back above it, but 16K fell."""
    lengths = [4096, 8192, 16384, 32768]
    assert effective_length(lengths, [95.0, 90.0, 80.0, 88.0], 85.6) == 8192
    assert effective_length(lengths, [85.6, 99.0, 99.0, 99.0], 85.6) is None
    assert effective_length(lengths, [90.0] * 4, 85.6) == 32768
    recipe = load_recipe("tiny", ["eval.task=ruler", "eval.threshold=60"])
    summary = ruler_summary({"a": {4096: (100.0, 2), 8192: (50.0, 2)},
                             "b": {4096: (40.0, 2), 8192: (90.0, 2)}}, recipe)
    assert summary["average"] == [70.0, 70.0] and summary["effective_length"] == 8192
    assert set(summary["skipped"]) == {"qa_1", "qa_2"}


# lm-eval 0.4.13's niah_single_1 sample at max_length 1024, written by hand in the format
# its generator writes (lm_eval/tasks/ruler/prepare_niah.py: index, input, outputs, length,
# max_length, gen_prefix): its generator needs a Hugging Face tokenizer folder and
# downloads nltk's punkt_tab at import, which the test machines cannot.
LM_EVAL_SAMPLE = {
    "index": 0,
    "input": "A special magic number is hidden within the following text. Make sure to "
             "memorize it. I will quiz you about the number afterwards.\nThe grass is green. "
             "The sky is blue. The sun is yellow. Here we go. There and back again.\nOne of "
             "the special magic numbers for obscene-parade is: 5712305.\nThe grass is green. "
             "The sky is blue. The sun is yellow. Here we go. There and back again.\nWhat is "
             "the special magic number for obscene-parade mentioned in the provided text?",
    "outputs": ["5712305"], "length": 536, "max_length": 1024,
    "gen_prefix": "The special magic number for obscene-parade mentioned in the provided "
                  "text is"}


def test_lm_eval_samples_are_read_with_their_answer_prefix(tmp_path):
    path = tmp_path / "niah_single_1.jsonl"
    path.write_text(json.dumps(LM_EVAL_SAMPLE) + "\n" + json.dumps(
        {**LM_EVAL_SAMPLE, "index": 1, "outputs": ["7", "8"]}) + "\n")
    recipe = load_recipe("tiny", [f"eval.samples={path}", "eval.seq_len=1024"])
    [(task, length, samples)] = file_cells(recipe.for_evaluation())
    assert (task, length, len(samples)) == ("niah_single_1", 1024, 2)
    [first] = samples[0]
    [(start, stop)] = first.strings
    assert decode_tokens(first.tokens[:start]) == (
        LM_EVAL_SAMPLE["input"] + " " + LM_EVAL_SAMPLE["gen_prefix"])
    assert decode_tokens(first.tokens[start:stop]) == " 5712305"
    [second] = samples[1]
    assert [decode_tokens(second.tokens[a:b]) for a, b in second.strings] == [" 7", " 8"]

    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({**LM_EVAL_SAMPLE, "max_length": 256}) + "\n")
    with pytest.raises(RecipeError, match=rf"eval.samples: {short} line 1 \(short\): the "
                                          r"sample takes 54\d tokens, more than the 256 it is "
                                          r"meant for; make the samples with the model's"):
        list(file_cells(load_recipe("tiny", [f"eval.samples={short}"]).for_evaluation()))


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


# ------------------------------------------------------------------ the copy model ----

COPY_DISTANCE = 129  # the default run's model predicts token t from token t - 129


def copier_sample(rng, outputs, planted, task):
    """A 256-token sample (bytes) whose answer strings in `planted` also stand 129 tokens
    before their place in the answer, so a copier writes those and only those."""
    answer = "".join(f"{',' if i else ''} {value}" for i, value in enumerate(outputs))
    prompt = list("".join(rng.choice(list("qwrtypsdfghjklzxcvbnm"), 256 - len(answer))))
    offset = 0
    for i, value in enumerate(outputs):
        piece = f"{',' if i else ''} {value}"
        if i in planted:
            start = len(prompt) + offset + piece.index(" ") - COPY_DISTANCE
            prompt[start:start + len(value) + 1] = " " + value
        offset += len(piece)
    return {"task": task, "input": "".join(prompt), "outputs": outputs, "length": 256}


def by_hand(sample) -> float:
    """What a copier scores: the share of strings all of whose tokens equal the token
    129 before."""
    text = sample["input"] + "".join(f"{',' if i else ''} {v}"
                                     for i, v in enumerate(sample["outputs"]))
    found, at = [], len(sample["input"])
    for i, value in enumerate(sample["outputs"]):
        at += 1 if i else 0
        span = range(at, at + len(value) + 1)
        found.append(all(text[t] == text[t - COPY_DISTANCE] for t in span))
        at += len(value) + 1
    return 100 * float(np.mean(found))


def test_the_copy_model_scores_what_a_copier_must_on_every_mesh(copy_model, tmp_path):
    """Three tasks of one sample each, their strings planted 129 tokens back or not: a
    copier finds 1 of 1, 2 of 4 and 0 of 3 strings. The default run's model gets exactly
    those scores on one device and under ring attention over 4 devices x 2."""
    from lctrain.trainer.evaluation.evaluate import evaluate

    rng = np.random.default_rng(0)
    samples = [copier_sample(rng, ["ab12"], {0}, "one"),
               copier_sample(rng, ["k1", "k22", "k333", "k4"], {0, 2}, "half"),
               copier_sample(rng, ["x9", "y8", "z7"], set(), "none")]
    expected = {sample["task"]: by_hand(sample) for sample in samples}
    assert expected == {"one": 100.0, "half": 50.0, "none": 0.0}
    path = tmp_path / "copy.jsonl"
    path.write_text("".join(json.dumps(sample) + "\n" for sample in samples))
    for mesh in (["parallel.strategy=none", "mesh.context=1"],
                 ["parallel.strategy=ring", "mesh.context=4"]):
        result = evaluate(load_recipe("tiny", [f"eval.samples={path}", "eval.batches=1",
                                               *mesh]), copy_model[0])
        ruler = result["ruler"]
        assert ruler["lengths"] == [256]
        assert {task: scores[0] for task, scores in ruler["scores"].items()} == expected, mesh
        assert ruler["average"] == [50.0] and ruler["effective_length"] is None


def test_ruler_table_and_picture(tmp_path):
    from rich.console import Console

    from lctrain.cli.eval_report import write_outputs
    from lctrain.cli.ruler_report import render_ruler

    recipe = load_recipe("tiny", ["eval.task=ruler"])
    ruler = ruler_summary({"vt": {4096: (100.0, 8), 8192: (87.5, 4)},
                           "cwe": {4096: (90.0, 8), 8192: (50.0, 4)}}, recipe)
    out = io.StringIO()
    render_ruler(ruler, Console(file=out, width=120))
    text = out.getvalue()
    rows = {cells[0]: cells[1:] for cells in
            ([cell.strip() for cell in line.strip("│").split("│")]
             for line in text.splitlines() if line.startswith("│"))}
    assert rows == {"vt": ["100.0", "87.5"], "cwe": ["90.0", "50.0"], "average": ["95.0", "68.8"]}
    assert "effective length at 85.6: 4,096 tokens" in text
    assert "qa_1: skipped" in text
    result = {"weights": "w", "seq_len": 8192, "vocab": 128, "loss": 1.0, "perplexity": 2.7,
              "accuracy": 0.5, "tokens": 1, "ruler": ruler,
              "by_position": {"edges": [0, 1], "tokens": [1], "loss": [1.0],
                              "accuracy": [0.5]}}
    written = write_outputs(result, tmp_path / "out")
    assert [p.name for p in written] == ["eval.json", "loss_by_position.png", "ruler.json",
                                         "ruler.png"]
    assert json.loads((tmp_path / "out" / "ruler.json").read_text())["effective_length"] == 4096
