"""Recipes: the typed schema, the loader, and the built-in YAML recipes beside them."""

from .loader import builtin_recipes, load_recipe, load_run_recipe, named_strategy, validate
from .mesh_checks import check_against_devices, resolve_mesh, stored_chunks
from .schema import MODEL_PRESETS, REMAT_TENSORS, Recipe, RecipeError

__all__ = ["MODEL_PRESETS", "REMAT_TENSORS", "Recipe", "RecipeError", "builtin_recipes",
           "check_against_devices", "load_recipe", "load_run_recipe", "named_strategy",
           "resolve_mesh",
           "stored_chunks", "validate"]
