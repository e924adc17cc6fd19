"""RULER against lm-eval's own generators: their frozen samples read through eval.samples,
and lctrain's generator giving samples of their shape (template, counts, lengths)."""

import json
import re
from pathlib import Path

import pytest

from lctrain.recipes import RecipeError, load_recipe
from lctrain.trainer.evaluation.ruler import file_cells, generated_cells

# lm-eval 0.4.13's own samples (its generators in lm_eval/tasks/ruler/, called by
# tests/data/ruler_lm_eval/make_samples.py; README.md there): 3 samples each of
# niah_single_1, niah_multikey_1, niah_multivalue, vt and cwe at max_length 2048, in the
# tokens of the 512-id BPE tokenizer beside them.
LM_EVAL = Path(__file__).parent / "data" / "ruler_lm_eval"
LM_EVAL_LENGTH = 2048
# RULER's tokens_to_generate: what a sample leaves of max_length for the answer.
TO_GENERATE = {"niah_single_1": 128, "niah_multikey_1": 128, "niah_multivalue": 128, "vt": 30,
               "cwe": 120}
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE_TEXT = re.compile(r"One of the special magic numbers for (\S+) is: (\d+)\.")


def lm_eval_records() -> dict[str, list[dict]]:
    records: dict[str, list[dict]] = {}
    for line in (LM_EVAL / "samples.jsonl").read_text().splitlines():
        record = json.loads(line)
        records.setdefault(record["task"], []).append(record)
    return records


def lm_eval_recipe(*overrides):
    return load_recipe("tiny", [f"data.tokenizer={LM_EVAL / 'tokenizer'}", "model.vocab=512",
                                f"eval.seq_len={LM_EVAL_LENGTH}", *overrides]).for_evaluation()


def lm_eval_tokenizer():
    from lctrain.trainer.data.tokenizer import DocumentTokenizer

    return DocumentTokenizer.load(LM_EVAL / "tokenizer").tokenizer


def test_lm_eval_samples_are_read_with_their_answer_prefix(tmp_path):
    """lm-eval's samples through eval.samples: each prompt is its input and, after a space,
    its gen_prefix, in the tokens lm-eval counted (its `length` less tokens_to_generate,
    for the needle tasks, whose length is the input's); each expected string follows, laid
    out as RULER's answer (cwe numbered, vt by spaces, the values by commas)."""
    records, tokenizer = lm_eval_records(), lm_eval_tokenizer()
    tokens = lambda text: tokenizer.encode(text, add_special_tokens=False).ids
    cells = list(file_cells(lm_eval_recipe(f"eval.samples={LM_EVAL / 'samples.jsonl'}")))
    assert [(task, length, len(samples)) for task, length, samples in cells] == [
        (task, LM_EVAL_LENGTH, 3) for task in sorted(TO_GENERATE)]
    for task, _, samples in cells:
        for [sample], record in zip(samples, records[task], strict=True):
            start = sample.strings[0][0] - (len(tokens(" 1.")) if task == "cwe" else 0)
            assert tokenizer.decode(sample.tokens[:start].tolist()) == (
                record["input"] + " " + record["gen_prefix"]), task
            if task.startswith("niah"):
                assert start == record["length"] - TO_GENERATE[task] + len(
                    tokens(" " + record["gen_prefix"])), task
            found = [tokenizer.decode(sample.tokens[a:b].tolist()) for a, b in sample.strings]
            assert found == [f" {value}" for value in record["outputs"]], task
            assert len(sample.tokens) <= LM_EVAL_LENGTH

    first = records["niah_single_1"][0]
    short = tmp_path / "niah_single_1.jsonl"
    short.write_text(json.dumps({**first, "max_length": 256}) + "\n")
    with pytest.raises(RecipeError, match=rf"eval.samples: {short} line 1 \(niah_single_1\): "
                                          r"the sample takes 1,8\d\d tokens, more than the 256 "
                                          r"it is meant for; make the samples with the model's"):
        list(file_cells(lm_eval_recipe(f"eval.samples={short}")))


def shape_lines(text: str) -> list[str]:
    """A prompt's template: its lines that are not context (noise, needles, chain links,
    numbered words), with the numbers, needle keys, variable names and listed words
    masked and whitespace dropped: what RULER's template puts around the context."""
    context = re.compile(r"(The grass|The sky|The sun|Here we go|There and|One of the special|"
                         r"VAR |\d+\. )")
    lines = []
    for line in text.split("\n"):
        if not line.strip() or context.match(line.strip()):
            continue
        line = re.sub(r"(\d+\.\s*[a-z][a-z-]*\s*)+", "<words>", line)  # cwe's numbered answer
        line = re.sub(r"\b[a-z]+-[a-z]+\b", "<key>", line)
        line = re.sub(r"\b[A-Z]{3,5}\b", "<var>", line)
        lines.append(re.sub(r"\s+", "", re.sub(r"\d+", "<n>", line)))
    return lines


def test_lctrains_generator_gives_samples_of_lm_evals_shape():
    """lctrain's generator at lm-eval's length and tokenizer against lm-eval's samples:

    - template: the same lines around the context (shape_lines: numbers, keys, variable
      names and words masked);
    - needles: as many in the prompt (1, 4, 4; niah_single_1's haystack the noise lines),
      the same number of expected strings, each in the prompt; vt's chain of 5 variables in
      its example and its question; cwe's 10 common words 6 times each, the others once
      (RULER's repeats below 4,096 tokens), its example 20 words;
    - length: RULER (lm-eval's prepare_niah.generate_samples, vt_utils, cwe_utils) keeps a
      sample's input and tokens_to_generate within max_length, its haystack the largest of
      its search steps that fits with the answer: lm-eval's prompts (input and answer
      prefix) fall short of max_length - tokens_to_generate by less than one step and the
      answer: 5 noise lines for niah_single_1 below 4,096 tokens, 500 essay words, 10 noise
      lines for vt, 10 listed words for cwe. lctrain's prompts are within that tolerance of
      lm-eval's, and, as ruler_tasks.py says (the context built in tokens fills its length
      in one pass), within one noise line under max_length - tokens_to_generate.

    Where lctrain's generator says it differs, the difference: its keys and words are
    pseudo-words; an essay needle goes in at a token (here inside the noise's sentences,
    lm-eval's at sentence ends), and the essay's pieces, tokenized on their own, take more
    tokens than their joined text. Where lm-eval differs from RULER: its cwe input leaves the
    example out (input_example, which its task's doc_to_text does not show), so lctrain's
    prompt is compared with the example before it, as RULER writes it. vt's example has 5
    noise lines in lctrain's, as many as fit 500 tokens in lm-eval's (10 here)."""
    records, tokenizer = lm_eval_records(), lm_eval_tokenizer()
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)
    noise_line = count("\n" + NOISE)
    steps = {"niah_single_1": 5 * noise_line, "vt": 10 * count(" " + NOISE + "\n"),
             "niah_multikey_1": count(" ".join(" ".join([NOISE] * 40).split(" ")[:500]))}
    steps["niah_multivalue"] = steps["niah_multikey_1"]
    pseudo = re.compile(r"([bdfghklmnprstvz][aeiou]){3}")
    for task, generate in TO_GENERATE.items():
        recipe = lm_eval_recipe(f"eval.task={task}", "eval.lengths=1", "data.batch_size=3")
        [(_, _, samples)] = generated_cells(recipe, None, 0)
        room = LM_EVAL_LENGTH - generate
        for [ours], theirs in zip(samples, records[task], strict=True):
            separator = count(" 1.") if task == "cwe" else 0
            ours_length = ours.strings[0][0] - separator  # the tokens the model is given
            prompt = tokenizer.decode(ours.tokens[:ours_length].tolist())
            strings = [tokenizer.decode(ours.tokens[a:b].tolist()).strip()
                       for a, b in ours.strings]
            reference = theirs["input"] + " " + theirs["gen_prefix"]
            answer = " ".join(theirs["outputs"])
            if task == "cwe":
                assert theirs["input"].count("Below is a numbered list") == 1
                reference = theirs["input_example"] + "\n" + reference
                answer = " ".join(f"{i + 1}. {w}" for i, w in enumerate(theirs["outputs"]))
                items = re.findall(r"\d+\. [a-z][a-z-]*", theirs["input"])
                steps["cwe"] = 10 * max(count(f" {item}") for item in items)
            assert shape_lines(prompt) == shape_lines(reference), task
            assert len(shape_lines(prompt)) == (4 if task in ("vt", "cwe") else 2), task
            assert len(strings) == len(theirs["outputs"]) and all(s in prompt for s in strings)
            assert prompt.count("One of the special magic") == \
                reference.count("One of the special magic"), task

            theirs_length = count(reference)
            tolerance = steps[task] + count(" " + answer)
            assert room - noise_line < ours_length <= room, (task, ours_length)
            assert room - tolerance < theirs_length < ours_length + count(theirs["gen_prefix"])
            assert abs(ours_length - theirs_length) < tolerance, (task, ours_length)

            if task.startswith("niah"):
                ours_needles = NEEDLE_TEXT.findall(prompt)
                assert all(pseudo.fullmatch(part) for key, _ in ours_needles
                           for part in key.split("-"))
                assert not all(pseudo.fullmatch(part) for key, _ in NEEDLE_TEXT.findall(reference)
                               for part in key.split("-"))
            if task == "niah_single_1":
                for text in (prompt, reference):
                    lines = text.split("\n")[1:-1]
                    assert {line for line in lines if not NEEDLE_TEXT.fullmatch(line)} == {NOISE}
            elif task.startswith("niah"):  # essay needles: lm-eval's at sentence ends
                theirs_at = [reference[m.start() - 2:m.start()] for m in
                             NEEDLE_TEXT.finditer(reference)]
                assert set(theirs_at) <= {". ", ".\n"}
                ours_at = [prompt[m.start() - 2:m.start()] for m in NEEDLE_TEXT.finditer(prompt)]
                assert set(ours_at) - {". ", ".\n"}, ours_at
                # Built from pieces tokenized on their own: the joined text takes fewer.
                assert count(prompt) < ours_length
            if task == "vt":
                for text in (prompt, reference):
                    example, question = text.split("Memorize and track")[1:]
                    for part, letters in ((example, 3), (question, 5)):
                        chain = re.findall(r"VAR ([A-Z]+) = (?:VAR ([A-Z]+)|\d+)", part)
                        assert len(chain) == 5 and {len(v) for v, _ in chain} == {letters}
                        assert [b for _, b in chain[1:]] == [a for a, _ in chain[:-1]]
                chain = re.findall(r"VAR ([A-Z]+) = ", prompt.split("Memorize and track")[2])
                assert chain == strings
                chain = re.findall(r"VAR ([A-Z]+) = ", reference.split("Memorize and track")[2])
                assert chain == theirs["outputs"]
                assert prompt.split("Question")[0].count(NOISE) == 5
                assert reference.split("Question")[0].count(NOISE) == 10
            if task == "cwe":
                for text, outputs in ((prompt, strings), (reference, theirs["outputs"])):
                    example, listed = [re.findall(r"\d+\. ([a-z][a-z-]*)",
                                                  part.split("Question")[0])
                                       for part in text.split("Below is")[1:]]
                    assert len(example) == 40 and len(set(example)) == 20
                    counts = {word: listed.count(word) for word in set(listed)}
                    assert {counts[word] for word in outputs} == {6}, task
                    assert set(counts.values()) == {6, 1} and sum(
                        c == 6 for c in counts.values()) == 10
                assert all(pseudo.fullmatch(word) for word in strings)
                assert not all(pseudo.fullmatch(word) for word in theirs["outputs"])
