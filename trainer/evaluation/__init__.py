"""`lctrain eval` and the eval during training: loss by position (evaluate.py) and needle
or passkey retrieval (retrieval.py).

May import recipes/, parallel/ and trainer.{outputs, model, data, state, hf}."""
