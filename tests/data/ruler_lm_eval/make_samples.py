"""Makes tests/data/ruler_lm_eval/: lm-eval's own RULER samples, frozen for tests/test_ruler_lm_eval.py
(not run by the suite). Run it with lm-eval's Python, not lctrain's:

    python3.11 -m venv /tmp/lmeval
    /tmp/lmeval/bin/pip install lm_eval==0.4.13 wonderwords nltk transformers
    /tmp/lmeval/bin/python tests/data/ruler_lm_eval/make_samples.py

It calls the functions lm_eval/tasks/ruler/ builds its datasets with (no evaluation runs),
at max_length 2048 with the tokenizer it writes beside it (tokenizer/: a byte-level BPE of
512 ids trained on RULER's template text, so the samples are a few thousand characters),
3 samples a task. lm-eval's essay haystack (niah_multikey_1, niah_multivalue) downloads
Paul Graham's essays and nltk's punkt_tab, which this machine cannot: its essay is RULER's
noise paragraph repeated (what lctrain's generator uses without eval.source), split into
sentences at ". " (what punkt does on that text)."""

import json

import random
import re
import sys
from pathlib import Path

import numpy
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).parent
LENGTH, SAMPLES = 2048, 3
NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
         "again.")
TEMPLATES = [  # RULER's template text (lctrain's ruler_tasks.py spells the same)
    "Some special magic numbers are hidden within the following text. Make sure to memorize "
    "it. I will quiz you about the numbers afterwards. What are all the special magic numbers "
    "for the key mentioned in the provided text? One of the special magic numbers for the key "
    "is: 1234567.",
    "Memorize and track the chain(s) of variable assignment hidden in the following text. "
    "Question: Find all variables that are assigned the value 12345 in the text above. Answer: "
    "According to the chain(s) of variable assignment in the text above, 5 variables are "
    "assgined the value 12345, they are: VAR ABCDE = VAR FGHIJ",
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often. Question: What are the 10 most common words in "
    "the above list? Answer: The top 10 words that appear most often in the list are: 1. 2. 3.",
    NOISE]


def write_tokenizer(folder: Path) -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TEMPLATES * 20, trainer=trainer)
    folder.mkdir(exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}, indent=1) + "\n")


def main() -> None:
    write_tokenizer(HERE / "tokenizer")
    from transformers import AutoTokenizer

    import lm_eval
    from lm_eval.tasks.ruler import cwe_utils, niah_utils, prepare_niah, vt_utils

    prepare_niah.cached_sent_tokenize = lambda text: re.split(r"(?<=\.) ", text)
    essay = " ".join([NOISE] * 2000).split(" ")
    tokenizer = AutoTokenizer.from_pretrained(str(HERE / "tokenizer"))
    niah = dict(max_seq_length=LENGTH, template=niah_utils.TEMPLATE, type_needle_k="words",
                type_needle_v="numbers", num_samples=SAMPLES, TOKENIZER=tokenizer)
    random.seed(0)  # lm-eval seeds nothing but its shuffles: fix the draws
    numpy.random.seed(0)
    samples = {
        "niah_single_1": prepare_niah.generate_samples(
            prepare_niah.get_haystack(type_haystack="repeat"), type_haystack="repeat", **niah),
        "niah_multikey_1": prepare_niah.generate_samples(
            essay, type_haystack="essay", num_needle_k=4, **niah),
        "niah_multivalue": prepare_niah.generate_samples(
            essay, type_haystack="essay", num_needle_v=4, **niah),
        # vt_utils.get_dataset and cwe_utils.get_dataset, at 3 samples instead of 500
        "vt": vt_utils.sys_vartrack_w_noise_random(
            tokenizer=tokenizer, num_samples=SAMPLES, max_seq_length=LENGTH,
            icl_example=vt_utils.sys_vartrack_w_noise_random(
                tokenizer=tokenizer, num_samples=1, max_seq_length=500, incremental=5)[0]),
        "cwe": cwe_utils.sys_word_pair_random(num_samples=SAMPLES, max_seq_length=LENGTH,
                                              tokenizer=tokenizer),
    }
    with open(HERE / "samples.jsonl", "w") as out:
        for task, records in samples.items():
            for record in records:
                out.write(json.dumps({"task": task, **record}) + "\n")
    print(f"lm_eval {lm_eval.__version__ if hasattr(lm_eval, '__version__') else '?'}, "
          f"python {sys.version.split()[0]}: {sum(map(len, samples.values()))} samples")


if __name__ == "__main__":
    main()
