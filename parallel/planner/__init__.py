"""Per-device memory and communication of each context-parallel strategy, before compiling.

`plan(recipe, chip, axis_sizes)` estimates, for every strategy the recipe's mesh allows,
what one device holds in HBM (and pinned host memory) at the step's peak and what it
receives over the interconnect per step, how long that takes against the step's compute,
and recommends one. Every figure is a formula over the shapes the code creates; the
formulas were derived from `trainer/model/transformer.py`, `trainer/model/loss.py`,
`trainer/state/step.py`, `parallel/sharding.py` and the strategy files, then checked
against what XLA's TPU compiler does with them (`lctrain plan --compile`,
`tests/test_planner.py -m slow`).
Where the compiler does something the code does not say, the term says so.

One module per concern, each with its part of the model in its docstring:
  shapes     the notation and one device's dimensions (Dims); the parameters and FLOPs
             per token are parallel/model_arithmetic.py's, which the trainer reads too
  memory     HBM and host bytes at the peak, and the calibration against XLA
  traffic    bytes received per step, by source and collective kind
  timing     compute and communication time, what the step waits for
  estimate   one strategy's plan: those common terms plus the strategy's own cost model
             (parallel/cost_model.py; each strategy's file holds its formulas)
  choice     the strategies the mesh allows and the recommendation
  search     the longest sequence that fits
  compiled   XLA's own figures (--compile)
  results    StrategyPlan, Plan and their JSON
"""

from __future__ import annotations

from lctrain.parallel.model_arithmetic import count_parameters, parameter_tensors
from lctrain.parallel.planner.accuracy import STEP_TIME_ERROR
from lctrain.parallel.planner.choice import TIE, against_recipe, candidates, plan, recommend
from lctrain.parallel.planner.compiled import (Timer, attach_compiled, compile_figures,
                                               compiled_fits)
from lctrain.parallel.planner.estimate import estimate, recipe_for_strategy
from lctrain.parallel.planner.memory import CALIBRATION, kernel_impl
from lctrain.parallel.planner.results import Plan, StrategyPlan, gap_percent
from lctrain.parallel.planner.search import (COMPILED_BISECT_STEPS, longest_sequences, max_fitting,
                                             max_seq_len, sequence_quantum, with_seq_len)
from lctrain.parallel.planner.shapes import local_elements, loss_chunks, mlp_chunk_len
from lctrain.parallel.planner.traffic import KINDS

__all__ = [
    "CALIBRATION", "COMPILED_BISECT_STEPS", "KINDS", "STEP_TIME_ERROR", "TIE",
    "Plan", "StrategyPlan", "Timer", "against_recipe", "attach_compiled", "candidates",
    "compile_figures",
    "compiled_fits", "count_parameters", "estimate", "gap_percent", "kernel_impl",
    "local_elements", "longest_sequences", "loss_chunks", "max_fitting", "max_seq_len",
    "mlp_chunk_len", "parameter_tensors", "plan", "recipe_for_strategy", "recommend",
    "sequence_quantum", "with_seq_len",
]
