"""The train state: a run built for its devices and compiled (build.py), initialised and
stepped (step.py), optimised (optimizer.py), saved and restored (checkpoint.py).

May import kernels/, recipes/, parallel/ and trainer.{outputs, model, data}."""
