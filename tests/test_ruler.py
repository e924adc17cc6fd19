"""RULER (eval.task ruler, eval.samples): samples of RULER's shape, the same for a seed and
on every mesh; the effective length; scores logged during
training; and, on the copy-task model, the scores a copier must get (string_match_all and
string_match_part), the same under every context-parallel strategy as without. QA's own
tests: test_ruler_qa.py; lm-eval's own samples: test_ruler_lm_eval.py."""

import io
import json
from pathlib import Path

import numpy as np
import pytest

from lctrain.recipes import RecipeError, load_recipe
from lctrain.trainer.data.batches import decode_tokens
from lctrain.trainer.evaluation.ruler import (check_ruler, effective_length, generated_cells,
                                              ruler_summary, unfit_lengths)
from lctrain.trainer.evaluation.ruler_tasks import TASKS
from lctrain.trainer.state.step import BATCH_FIELDS

# Byte-level text (ASCII fits the tiny model's 128 ids): 8,192 bytes hold every task.
GENERATED = ["eval.task=ruler", "eval.seq_len=8192", "eval.lengths=1", "data.batch_size=1"]
NEEDLE = "One of the special magic"
SQUAD = Path(__file__).parent / "data" / "squad_tiny.json"


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


def test_a_task_longer_than_its_length_is_an_error():
    recipe = load_recipe("tiny", ["eval.task=cwe", "eval.seq_len=4096", "eval.lengths=1"])
    with pytest.raises(RecipeError, match=r"eval.task cwe at 4,096 tokens: the sample takes "
                                          r"[\d,]+ tokens, more than the 4,096"):
        next(generated_cells(recipe.for_evaluation(), None, 0))
    # The group skips cwe where its byte-token template cannot fit (4,096: its counts grow
    # there) and scores it at 2,048 and 8,192; cwe alone stops before anything compiles.
    group = load_recipe("tiny", ["eval.task=ruler", "eval.seq_len=8192", "eval.lengths=3"])
    assert {task: list(lengths) for task, lengths in
            unfit_lengths(group.for_evaluation()).items()} == {"cwe": [4096]}
    check_ruler(group.for_evaluation())
    with pytest.raises(RecipeError, match=r"eval.task cwe at 4,096 tokens: the sample takes"):
        check_ruler(load_recipe("tiny", ["eval.task=cwe", "eval.seq_len=8192",
                                         "eval.lengths=3"]).for_evaluation())


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


# ------------------------------------------------------------------ the copy model ----

COPY_DISTANCE = 129  # the default run's model predicts token t from token t - 129
# Every context-parallel strategy over data 2 x context 4 (usp: Ulysses 2 x ring 2), and the
# reference: no context parallelism.
MESHES = {"none": ["parallel.strategy=none", "mesh.context=1"],
          **{strategy: [f"parallel.strategy={strategy}", "mesh.context=4"]
             for strategy in ("all_gather", "ulysses", "ring")},
          "usp": ["parallel.strategy=usp", "mesh.context=4", "parallel.ulysses=2"]}


def laid_out(task, outputs):
    """Each alternative answer as the model writes it, with its strings' spans in it: a QA
    task's answers each alone, any other's strings after commas (docs/evaluation.md)."""
    if task.startswith("qa"):
        return [(f" {value}", [(0, len(value) + 1)]) for value in outputs]
    text, spans = "", []
    for i, value in enumerate(outputs):
        text += "," if i else ""
        spans.append((len(text), len(text) + len(value) + 1))
        text += f" {value}"
    return [(text, spans)]


def copier_sample(rng, task, outputs, planted):
    """A 256-byte sample whose strings numbered in `planted` (over all its alternatives)
    also stand 129 bytes before their place, so a copier writes those and only those."""
    alternatives = laid_out(task, outputs)
    prompt = list(rng.choice(list("qwrtypsdfghjklzxcvbnm"),
                             256 - max(len(answer) for answer, _ in alternatives)))
    strings = [(answer, span) for answer, spans in alternatives for span in spans]
    for index in planted:
        answer, (start, stop) = strings[index]
        at = len(prompt) + start - COPY_DISTANCE
        prompt[at:at + stop - start] = answer[start:stop]
    return {"task": task, "input": "".join(prompt), "outputs": outputs, "length": 256}


def by_hand(sample) -> float:
    """What a copier scores: the best alternative's share of strings all of whose bytes
    equal the byte 129 before."""
    shares = []
    for answer, spans in laid_out(sample["task"], sample["outputs"]):
        text, base = sample["input"] + answer, len(sample["input"])
        shares.append(np.mean([all(text[t] == text[t - COPY_DISTANCE]
                                   for t in range(base + start, base + stop))
                               for start, stop in spans]))
    return 100 * max(shares)


def copier_file(tmp_path):
    """(samples file, each task's score by hand): four strings per task, so every cell
    compiles the same scorer."""
    rng = np.random.default_rng(0)
    samples = [copier_sample(rng, "one", ["ab12", "cd34", "ef56", "gh78"], {0, 1, 2, 3}),
               copier_sample(rng, "half", ["k1", "k22", "k333", "k4"], {0, 2}),
               copier_sample(rng, "none", ["x9", "y8", "z7", "w6"], set()),
               copier_sample(rng, "qa_copy", ["zz9", "ab12"], {1}),
               copier_sample(rng, "qa_copy", ["x1", "y2"], set())]
    expected = {}
    for sample in samples:
        expected.setdefault(sample["task"], []).append(by_hand(sample))
    path = tmp_path / "copy.jsonl"
    path.write_text("".join(json.dumps(sample) + "\n" for sample in samples))
    return path, {task: float(np.mean(scores)) for task, scores in expected.items()}


def scored_on_mesh(recipe, run_dir):
    """(RULER's summary of the run dir's weights on the recipe's mesh, the batches it
    scored): the RULER pass alone, without eval's loss by position."""
    from lctrain.trainer.evaluation.evaluate import Evaluator
    from lctrain.trainer.hf.weights import load_weights
    from lctrain.trainer.state.build import mesh_for
    from lctrain.trainer.state.step import build_trainable

    mesh = mesh_for(recipe, evaluating=True)
    trainable = build_trainable(recipe, mesh)
    params, origin = load_weights(recipe, trainable, run_dir)
    evaluator = Evaluator(recipe, mesh, trainable.graphdef)
    batches, found = [], evaluator.found

    def recorded(params, batch, strings):
        batches.append(batch)
        return found(params, batch, strings)

    evaluator.found = recorded
    return evaluator.ruler(params, origin), batches


def test_every_strategy_scores_what_a_copier_must_on_the_same_samples(copy_model, tmp_path):
    """Four tasks, their strings planted 129 bytes back or not: a copier finds 4 of 4, 2 of
    4 and 0 of 4 strings, and one of two QA samples has an answer it writes (50). The
    default run's model gets exactly those scores without context parallelism, and under
    all_gather, ulysses, ring and usp the same summary from the same batches."""
    path, expected = copier_file(tmp_path)
    assert expected == {"one": 100.0, "half": 50.0, "none": 0.0, "qa_copy": 50.0}
    recipe = load_recipe("tiny", [f"eval.samples={path}", *MESHES["none"]])
    reference, reference_batches = scored_on_mesh(recipe, copy_model[0])
    assert {task: scores for task, scores in reference["scores"].items()} == \
        {task: [score] for task, score in expected.items()}
    assert reference["lengths"] == [256] and reference["average"] == [50.0]
    assert reference["effective_length"] is None
    for strategy, mesh in MESHES.items():
        if strategy != "none":
            ruler, batches = scored_on_mesh(load_recipe("tiny", [f"eval.samples={path}", *mesh]),
                                            copy_model[0])
            assert ruler == reference, strategy
            for ours, theirs in zip(batches, reference_batches, strict=True):
                for field in BATCH_FIELDS:
                    np.testing.assert_array_equal(getattr(ours, field), getattr(theirs, field))


def tensorboard_scalars(run_dir):
    """{(tag, step): value} of every scalar in the run dir's TensorBoard events."""
    from tensorboardX.proto.event_pb2 import Event

    scalars = {}
    for path in (run_dir / "tb").glob("events.out.tfevents.*"):
        data, offset = path.read_bytes(), 0
        while offset + 12 <= len(data):  # TFRecords: length, its CRC, the event, its CRC
            length = int.from_bytes(data[offset:offset + 8], "little")
            event = Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 16 + length
            scalars.update({(value.tag, event.step): value.simple_value
                            for value in event.summary.value})
    return scalars


def test_training_logs_rulers_scores_and_checks_its_samples_first(tmp_path):
    """eval.every with a RULER task: every task's score and the average per length go to
    metrics.jsonl and TensorBoard as eval/ruler/<task>/<length> (the averages, by hand:
    (75 + 100) / 2 at 512, 50 alone at 1,024, where qa_1 was not scored), the averages to
    the console; and a run whose RULER samples cannot be built stops before compiling."""
    from rich.console import Console

    from lctrain.trainer.train.metrics import MetricsWriter
    from lctrain.trainer.train.preflight import check_run

    ruler = ruler_summary({"niah_single_1": {512: (75.0, 8), 1024: (50.0, 4)},
                           "qa_1": {512: (100.0, 8)}}, load_recipe("tiny", []))
    console = io.StringIO()
    writer = MetricsWriter(tmp_path, True, Console(file=console, width=300))
    writer.write_eval(4, {"loss": 1.0, "perplexity": 2.7, "accuracy": 0.5, "tokens": 10,
                          "ruler": ruler})
    writer.close()
    [logged] = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    expected = {"eval/ruler/niah_single_1/512": 75.0, "eval/ruler/niah_single_1/1024": 50.0,
                "eval/ruler/qa_1/512": 100.0, "eval/ruler/average/512": 87.5,
                "eval/ruler/average/1024": 50.0}
    assert {name: value for name, value in logged.items() if "ruler" in name} == expected
    scalars = tensorboard_scalars(tmp_path)
    assert {name: scalars[name, 4] for name in expected} == expected
    assert "| RULER at 512: 87.5 | RULER at 1024: 50.0" in console.getvalue()

    with pytest.raises(RecipeError, match=r"^eval.task niah_single_1 at 256 tokens: its "
                                          r"template and answer budget take 4\d\d tokens"):
        check_run(load_recipe("tiny", ["eval.every=2", "eval.task=niah_single_1",
                                       "eval.lengths=1"]), tmp_path)
    broken = tmp_path / "broken.json"
    broken.write_text("[")
    with pytest.raises(RecipeError, match=rf"^recipe key 'eval.squad' = '{broken}': not JSON"):
        check_run(load_recipe("tiny", ["eval.every=2", "eval.task=ruler", "eval.seq_len=8192",
                                       "eval.lengths=1", f"eval.squad={broken}"]), tmp_path)


def test_generated_samples_are_the_same_on_every_mesh(tmp_path):
    """The samples a seed gives depend on no mesh: qa_1 and niah_single_2 (its essay from a
    token file, rows of it by sample) built under each strategy's recipe equal those built
    without context parallelism: 8 samples each (8 rows of one 1,024-token sample)."""
    from lctrain.trainer.data.sources import make_source

    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(32, 127, 20_000).astype(np.int32))

    def samples(task, mesh):
        recipe = load_recipe("tiny", [f"eval.task={task}", f"eval.source={tokens}",
                                      "eval.seq_len=1024", "eval.lengths=1",
                                      f"eval.squad={SQUAD}", *mesh]).for_evaluation()
        source = make_source(recipe.data, vocab=128, seed=recipe.train.seed, split="eval")
        [(_, _, cell)] = generated_cells(recipe, source, recipe.train.seed)
        return [[alternative.tokens for alternative in sample] for sample in cell]

    for task in ("qa_1", "niah_single_2"):
        reference = samples(task, MESHES["none"])
        assert len(reference) == 8
        for strategy, mesh in MESHES.items():
            built = samples(task, mesh)
            assert [len(sample) for sample in built] == [len(sample) for sample in reference]
            for ours, theirs in zip(built, reference):
                for ours_tokens, theirs_tokens in zip(ours, theirs):
                    np.testing.assert_array_equal(ours_tokens, theirs_tokens, err_msg=strategy)


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
