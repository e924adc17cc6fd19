"""Tokens in: batches from token files and synthetic tasks (batches.py), tokenizers and
their sidecars (tokenizer.py), `lctrain tokenize` (corpus.py), weighted mixtures
(mixture.py), the recipe's sources opened (sources.py) and checked (checks.py).

May import recipes/, parallel/ and trainer.outputs; no jax."""
