"""Reads a YAML recipe into the typed `Recipe`, applies `--set` overrides and runs phase 1
of its checks: what the recipe says on its own, without jax, devices or data files (phase 2,
against the files and devices, is trainer/train/preflight.py).

Every error is a `RecipeError` whose message names the key, the value and what is allowed,
so the CLI can print it as one line and exit 2 before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from .coerce import build, coerce
from .hf_config import model_fields
from .linear_checks import validate_linear_layers
from .mesh_checks import validate_mesh
from .schema import (KIND_ONLY_STRATEGIES, LAYER_KINDS, MODEL_PRESETS, QA_FILES, REMAT_TENSORS,
                     ROPE_KEYS, ROPE_SCALING_KEYS, ModelConfig, Recipe, RecipeError,
                     read_rope_scaling_keys, require)

DEFAULT_RECIPE = "quickstart"


def builtin_recipes() -> list[str]:
    return sorted(p.name.removesuffix(".yaml") for p in resources.files(__package__).iterdir()
                  if p.name.endswith(".yaml"))


def load_recipe(path: str | os.PathLike | None = None, overrides: list[str] = ()) -> Recipe:
    """Loads a recipe file (or a built-in recipe by name; None = the default) and validates
    what it says on its own: phase 1 of its checks (no file is opened but model.init's
    config.json; phase 2, trainer/train/preflight.py, checks the data files and devices)."""
    return _load(_read_yaml(path), overrides)


def _load(raw: dict[str, Any], overrides: list[str]) -> Recipe:
    _apply_overrides(raw, overrides)
    _fill_model_keys(raw)
    recipe = build(Recipe, raw, prefix="")
    recipe = dataclasses.replace(recipe, model=_derived_model_keys(recipe.model))
    validate(recipe)
    return recipe


def named_strategy(path: str | os.PathLike | None = None, overrides: list[str] = ()) -> Any:
    """parallel.strategy as the recipe and its overrides name it, before any check: what
    `lctrain plan` (which weighs every strategy) shows first."""
    raw = _read_yaml(path)
    _apply_overrides(raw, overrides)
    parallel = raw.get("parallel")
    return parallel.get("strategy", "none") if isinstance(parallel, dict) else "none"


def _apply_overrides(raw: dict[str, Any], overrides: list[str]) -> None:
    for assignment in overrides:
        key, value = _parse_override(assignment)
        _set_dotted(raw, key, value)


def load_run_recipe(run_dir: str | os.PathLike, overrides: list[str] = ()) -> Recipe:
    """The recipe a run trained with (recipe.yaml in its run dir). Every model key is set
    there, so the model is rebuilt from them without model.init's folder."""
    path = Path(run_dir) / "recipe.yaml"
    if not path.is_file():
        raise RecipeError(f"{path}: missing, so '{run_dir}' is not a run dir; give the folder "
                          f"`lctrain run` trained into (--run-dir)")
    raw = _read_yaml(path)
    # Run dirs written before ROPE_SCALING_KEYS listed every rope_scaling key.
    scaling = (raw.get("model") or {}).get("rope_scaling")
    if isinstance(scaling, dict):
        raw["model"]["rope_scaling"] = read_rope_scaling_keys(scaling)
    return _load(raw, ["model.init=random", *overrides])


def _read_yaml(path: str | os.PathLike | None) -> dict[str, Any]:
    if path is None or (str(path) in builtin_recipes() and not Path(path).exists()):
        name = DEFAULT_RECIPE if path is None else str(path)
        text = resources.files(__package__).joinpath(f"{name}.yaml").read_text()
        source = f"built-in recipe '{name}'"
    else:
        if not Path(path).is_file():
            raise RecipeError(
                f"recipe file '{path}' does not exist; give a YAML file or one of the built-in "
                f"recipes: {', '.join(builtin_recipes())}")
        text = Path(path).read_text()
        source = str(path)
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise RecipeError(f"{source} is not valid YAML: {err}".replace("\n", " ")) from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{source} must be a mapping of sections (model:, data:, ...)")
    return raw


def _parse_override(assignment: str) -> tuple[str, Any]:
    key, sep, text = assignment.partition("=")
    if not sep or not key.strip():
        raise RecipeError(f"override '{assignment}' must look like section.key=value")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text
    return key.strip(), value


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    *sections, leaf = key.split(".")
    node = raw
    for name in sections:
        node = node.setdefault(name, {})
        if not isinstance(node, dict):
            raise RecipeError(f"override '{key}': '{name}' is not a section")
    node[leaf] = value


def _fill_model_keys(raw: dict[str, Any]) -> None:
    """Fills the unset model keys from model.init's config.json, or from the preset.

    Keys the recipe sets must agree with an imported config.json, except RoPE's (changing
    RoPE extends a context). A partial model.rope_scaling merges over the base's unless it
    names another type."""
    model = raw.setdefault("model", {})
    if not isinstance(model, dict):
        return  # build names the key
    hints = typing.get_type_hints(ModelConfig)
    init = model.get("init", "random")
    if isinstance(init, str) and init.startswith("hf:"):
        require("preset" not in model, "model.preset", model.get("preset"),
                 f"model.init={init} takes the architecture from config.json; remove "
                 f"model.preset")
        seq_len = (raw.get("data") or {}).get("seq_len", 256)
        base, source = model_fields(init[3:], seq_len), f"{init[3:]}/config.json"
    else:
        require(init == "random", "model.init", init, "use 'random' or 'hf:<model folder>'")
        preset = coerce("model.preset", model.get("preset", "tiny"), hints["preset"])
        base, source = MODEL_PRESETS[preset], None
    for key, value in base.items():
        given = model.get(key)
        if key == "rope_scaling":
            model[key] = _merged_rope_scaling(value, given)
        elif given is None:
            model[key] = value
        elif source and key not in ROPE_KEYS and (coerce(f"model.{key}", given, hints[key])
                                                  != coerce(f"model.{key}", value, hints[key])):
            raise RecipeError(f"recipe key 'model.{key}' = {given!r} disagrees with {source} "
                              f"({value!r}); leave it unset or make it equal")


def _merged_rope_scaling(base: dict[str, Any], given: Any) -> Any:
    if given is None:
        return dict(base)
    if not isinstance(given, dict):
        return given  # build names the key
    kind = given.get("type", base["type"])
    _require_read_by(kind, given, "type" not in given)
    return {**base, **given} if kind == base["type"] else given


def _require_read_by(kind: Any, given: dict[str, Any], inherited: bool) -> None:
    """Every model.rope_scaling key given is one that `kind` reads."""
    if kind not in ROPE_SCALING_KEYS:
        return  # build names the type
    for key in given:
        readers = [name for name, keys in ROPE_SCALING_KEYS.items() if key in keys]
        if not readers or kind in readers:
            continue  # type itself, or an unknown key that build names
        where = " (the model's own, as the recipe gives no type)" if inherited else ""
        choices = ", ".join(readers[:-1]) + (" or " if len(readers) > 1 else "") + readers[-1]
        raise RecipeError(
            f"recipe key 'model.rope_scaling.{key}' = {given[key]!r} is not used by "
            f"model.rope_scaling.type '{kind}'{where}; set model.rope_scaling.type to "
            f"{choices}, or remove the key")


def _derived_model_keys(model: ModelConfig) -> ModelConfig:
    """The model with the keys that default to others' values filled in."""
    if model.head_dim is None and model.n_heads > 0:
        require(model.d_model % model.n_heads == 0, "model.d_model", model.d_model,
                 f"must be divisible by model.n_heads ({model.n_heads}), or set model.head_dim")
        model = dataclasses.replace(model, head_dim=model.d_model // model.n_heads)
    if model.rope_scaling.original_max_position_embeddings is None:
        scaling = dataclasses.replace(
            model.rope_scaling, original_max_position_embeddings=model.max_position_embeddings)
        model = dataclasses.replace(model, rope_scaling=scaling)
    return model


def validate(recipe: Recipe) -> None:
    """Phase 1: the checks of the recipe's own values (no device, no data file)."""
    m, d, t = recipe.model, recipe.data, recipe.train
    for name in ("layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab"):
        require(getattr(m, name) > 0, f"model.{name}", getattr(m, name), "must be positive")
    require(m.head_dim % 2 == 0, "model.head_dim", m.head_dim, "must be even for RoPE")
    require(0 < m.partial_rotary_factor <= 1 and m.rotary_dim % 2 == 0,
            "model.partial_rotary_factor", m.partial_rotary_factor,
            f"must be in (0, 1] and rotate an even count of model.head_dim's {m.head_dim} "
            f"features")
    _validate_rope(m)
    _validate_layer_pattern(m)
    require(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads", m.n_kv_heads,
             f"must divide model.n_heads ({m.n_heads})")
    require(d.seq_len > 0, "data.seq_len", d.seq_len, "must be positive")
    require(d.batch_size > 0, "data.batch_size", d.batch_size, "must be positive")
    require(t.steps > 0, "train.steps", t.steps, "must be positive")
    require(t.lr > 0, "train.lr", t.lr, "must be positive")
    require(t.warmup_steps >= 0, "train.warmup_steps", t.warmup_steps, "must be >= 0")
    require(0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio", t.min_lr_ratio, "must be in [0, 1]")
    require(t.grad_clip >= 0, "train.grad_clip", t.grad_clip, "must be >= 0 (0 = off)")
    require(t.grad_accum_steps > 0, "train.grad_accum_steps", t.grad_accum_steps,
             "must be positive")
    require(d.batch_size % t.grad_accum_steps == 0, "data.batch_size", d.batch_size,
             f"must be divisible by train.grad_accum_steps ({t.grad_accum_steps})")
    _validate_layer_strategies(recipe)
    validate_linear_layers(recipe)
    validate_mesh(recipe)
    _validate_remat(recipe)
    for key in ("block_q", "block_kv"):
        block = getattr(recipe.attention, key)
        require(block is None or block > 0, f"attention.{key}", block,
                "must be positive (or null: the chip's measured default)")
    chunk = recipe.loss.chunk_tokens
    require(chunk is None or chunk >= 0, "loss.chunk_tokens", chunk,
             "must be >= 0 (0 = unchunked) or null (chosen from data.seq_len)")
    require(recipe.eval.batches > 0, "eval.batches", recipe.eval.batches, "must be positive")
    require(recipe.eval.seq_len is None or recipe.eval.seq_len > 1, "eval.seq_len",
             recipe.eval.seq_len, "must be at least 2, or null (data.seq_len)")
    _validate_eval_split(recipe)
    require(recipe.checkpoint.every >= 0, "checkpoint.every", recipe.checkpoint.every,
             "must be >= 0 (0 = only at the end)")
    require(recipe.checkpoint.keep >= 1, "checkpoint.keep", recipe.checkpoint.keep,
             "must be >= 1")
    cpu_devices = recipe.runtime.cpu_devices
    require(cpu_devices == "auto" or cpu_devices >= 0, "runtime.cpu_devices", cpu_devices,
             "must be >= 0 (0 = jax's default) or auto")
    require(recipe.runtime.log_every > 0, "runtime.log_every", recipe.runtime.log_every,
             "must be positive")


def _validate_eval_split(recipe: Recipe) -> None:
    e = recipe.eval
    require(e.every >= 0, "eval.every", e.every, "must be >= 0 (0 = no evaluation in training)")
    require(e.lengths >= 1, "eval.lengths", e.lengths, "must be >= 1")
    require(e.depths >= 1, "eval.depths", e.depths, "must be >= 1")
    require(0 <= e.holdout <= 0.5, "eval.holdout", e.holdout,
             "must be in [0, 0.5]: a share of data.source's windows, e.g. 0.01")
    require(0 <= e.threshold <= 100, "eval.threshold", e.threshold,
             "must be a score in percent, in [0, 100] (RULER's paper: 85.6)")
    require(e.samples is None or Path(e.samples).is_file(), "eval.samples", e.samples,
            f"no such file (looked for {Path(e.samples or '').absolute()}); give a .jsonl "
            f"of RULER's or lm-eval's samples")
    for key, dataset in QA_FILES.values():
        path = getattr(e, key)
        require(path is None or Path(path).is_file(), f"eval.{key}", path,
                f"no such file (looked for {Path(path or '').absolute()}); give {dataset}, as "
                f"RULER's scripts/data/synthetic/json/download_qa_dataset.sh downloads it")
    if e.every and e.source is None and (recipe.data.sources or recipe.data.source != "synthetic"):
        require(e.holdout > 0, "eval.every", e.every,
                 f"evaluating during training needs data it does not train on: set "
                 f"eval.holdout (e.g. 0.01) or eval.source (data.source is {recipe.data.source})")


def _validate_rope(m: ModelConfig) -> None:
    require(m.rope_theta > 0, "model.rope_theta", m.rope_theta, "must be positive")
    scaling = m.rope_scaling
    if scaling.type == "none":
        return
    require(scaling.factor > 0, "model.rope_scaling.factor", scaling.factor, "must be positive")
    require(scaling.original_max_position_embeddings > 0,
             "model.rope_scaling.original_max_position_embeddings",
             scaling.original_max_position_embeddings, "must be positive")
    if scaling.type == "llama3":
        require(scaling.high_freq_factor > scaling.low_freq_factor,
                 "model.rope_scaling.high_freq_factor", scaling.high_freq_factor,
                 f"must exceed model.rope_scaling.low_freq_factor ({scaling.low_freq_factor})")
    if scaling.type == "yarn":
        require(scaling.beta_fast > scaling.beta_slow, "model.rope_scaling.beta_fast",
                 scaling.beta_fast,
                 f"must exceed model.rope_scaling.beta_slow ({scaling.beta_slow})")


def _validate_layer_pattern(m: ModelConfig) -> None:
    """Every group has a count, a sliding one its window, and the groups of one kind agree
    (a kind's layers share one attend and one set of rotary tables)."""
    if m.layer_pattern is None:
        return
    require(len(m.layer_pattern) > 0, "model.layer_pattern", [],
            "give at least one {kind, count} group, or null (every layer global)")
    for i, group in enumerate(m.layer_pattern):
        key = f"model.layer_pattern[{i}]"
        require(group.count >= 1, f"{key}.count", group.count, "must be >= 1 (layers in the group)")
        if group.kind == "sliding":
            require(group.window is not None and group.window >= 1, f"{key}.window",
                    group.window, "a sliding group needs a window >= 1 (tokens each query "
                                  "sees, itself included, e.g. 4096)")
        else:
            require(group.window is None, f"{key}.window", group.window,
                    "only sliding groups take a window; remove it, or set kind: sliding")
        require(group.rope_theta is None or group.rope_theta > 0, f"{key}.rope_theta",
                group.rope_theta, "must be positive, or null (model.rope_theta)")
        first = m.layer_group(group.kind)
        for name in ("window", "rope_theta", "scale_rope"):
            require(getattr(group, name) == getattr(first, name), f"{key}.{name}",
                    getattr(group, name), f"the {group.kind} layers share one {name}, and an "
                    f"earlier {group.kind} group gives {getattr(first, name)!r}; make them equal")


def _validate_layer_strategies(recipe: Recipe) -> None:
    """parallel.strategy, one name or a map kind -> name, gives every layer kind of the
    model a strategy that can run it."""
    strategy, kinds = recipe.parallel.strategy, set(recipe.model.layer_kinds())
    if isinstance(strategy, dict):
        for kind, name in strategy.items():
            key = f"parallel.strategy.{kind}"
            require(kind in LAYER_KINDS, key, name,
                    f"unknown layer kind; the kinds are {', '.join(LAYER_KINDS)}")
            require(kind in kinds, key, name,
                    f"the model has no {kind} layers (model.layer_pattern over model.layers "
                    f"{recipe.model.layers}); remove the key")
        missing = sorted(kinds - set(strategy))
        require(not missing, "parallel.strategy", strategy,
                f"names no strategy for the {', '.join(missing)} layers; add "
                f"{missing[0] if missing else ''}: <strategy>, or give one name for every layer")
    if isinstance(strategy, dict) and recipe.parallel.ulysses > 1:
        # usp splits mesh.context into ring x all-to-all axes; the others (halo aside, which
        # exchanges over both) would see only the ring's part of the sequence split.
        for kind, name in strategy.items():
            require(name in ("usp", *KIND_ONLY_STRATEGIES),
                    f"parallel.strategy.{kind}",
                    name, f"parallel.ulysses {recipe.parallel.ulysses} is usp's split of "
                    f"mesh.context, which {name} does not run on; use usp for every kind "
                    f"(halo may stay on sliding layers), or parallel.ulysses=1")
    for kind, name in recipe.parallel.by_kind(kinds).items():
        only = KIND_ONLY_STRATEGIES.get(name, kind)
        require(only == kind,
                "parallel.strategy" + (f".{kind}" if isinstance(strategy, dict) else ""), name,
                f"{name} runs {only} layers only, and the model has {kind} layers; give "
                f"them another, e.g. parallel.strategy={{{kind}: ring, {only}: {name}}}")


def _validate_remat(recipe: Recipe) -> None:
    r = recipe.remat
    for name in r.tensors:
        require(name in REMAT_TENSORS, f"remat.tensors.{name}", r.tensors[name],
                 f"unknown tensor name; known: {', '.join(REMAT_TENSORS)}")
    if r.policy != "custom":
        require(not r.tensors, "remat.tensors", r.tensors,
                 f"only used with remat.policy=custom (policy is '{r.policy}')")
    require(r.mlp_chunk_tokens >= 0, "remat.mlp_chunk_tokens", r.mlp_chunk_tokens,
             "use a positive number of tokens, or 0 to run the MLP unchunked")
    if r.compiler_remat_percent is not None:
        require(1 <= r.compiler_remat_percent <= 100, "remat.compiler_remat_percent",
                 r.compiler_remat_percent, "use a percent of the HBM, 1 to 100, or null")
    every = r.layers_per_checkpoint
    require(1 <= every <= recipe.model.layers, "remat.layers_per_checkpoint", every,
             f"use 1 to model.layers ({recipe.model.layers})")
    if every > 1:
        require(r.policy != "save_all", "remat.layers_per_checkpoint", every,
                 "recomputes layers in backward, which remat.policy=save_all never does; "
                 "use full, minimal or custom")
        kinds = set(recipe.model.layer_kinds())
        require(kinds == {"global"}, "remat.layers_per_checkpoint", every,
                 f"serves models of global layers only (this one has "
                 f"{', '.join(sorted(kinds))} layers); use 1")
