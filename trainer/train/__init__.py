"""The training loop (loop.py), the checks a run passes before it (preflight.py), and what
runs beside it: where jax runs, set up before it starts (runtime.py), metrics (metrics.py),
the input pipeline off the critical path (pipeline.py), several processes (distributed.py),
starting from another run (init_from.py) and rerunning in a used run dir (resume.py).

The top of trainer/: may import every subpackage beside it."""
