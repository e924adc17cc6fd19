"""The strategy registry (parallel.STRATEGIES) against the names the recipe schema keeps
apart from it (it is read before jax starts): checked here, not by an import-time assert,
which `python -O` removes."""

from lctrain.parallel import STRATEGIES
from lctrain.recipes import schema


def test_the_schema_names_every_registered_strategy_and_auto():
    assert schema.STRATEGY_NAMES == (*STRATEGIES, "auto")


def test_each_strategy_has_its_own_simplicity_rank():
    """The planner's tie-break between strategies within a few percent of each other."""
    ranks = [cls.simplicity for cls in STRATEGIES.values()]
    assert len(set(ranks)) == len(ranks)
