"""The train state: the recipe checked against the devices (device_checks.py), a run built
for them and compiled (build.py), initialised and stepped (step.py), optimised
(optimizer.py), saved and restored (checkpoint.py).

May import kernels/, recipes/, parallel/ and trainer.{outputs, model, data}."""
