"""Checks of the mesh in both phases: at load (phase 1) what the recipe alone decides, and
against the devices (`check_against_devices`, from phase 2's trainer/state/device_checks.py
or from `lctrain plan`, which counts a topology's chips) what their count and slices decide.
No jax here: the devices come as a count."""

from __future__ import annotations

import math

from .schema import Recipe, require


def validate_mesh(recipe: Recipe) -> None:
    sizes = recipe.mesh.axis_sizes()
    for axis, size in sizes.items():
        require(size == -1 or size > 0, f"mesh.{axis}", size, "must be positive or -1 (fill)")
    fills = [axis for axis, size in sizes.items() if size == -1]
    require(len(fills) <= 1, f"mesh.{fills[-1] if fills else 'data'}", -1,
             f"only one mesh axis may be -1, got {', '.join(fills)}")
    for axis, degree in recipe.mesh.dcn_sizes().items():
        require(degree >= 1, f"mesh.dcn_{axis}", degree, "must be >= 1 (1: inside one slice)")
    if fills:
        _check_dcn_divides(recipe.mesh.dcn_sizes(), sizes)
    else:                                  # the mesh names every device it needs
        _check_slices(recipe, sizes, math.prod(sizes.values()), None)
    p = recipe.parallel
    if recipe.mesh.context != -1:
        _check_strategy_splits(recipe, recipe.mesh.context)
    require(p.ulysses >= 1, "parallel.ulysses", p.ulysses, "must be >= 1")
    if "usp" not in [name for _, name in p.keyed_names()]:
        require(p.ulysses == 1, "parallel.ulysses", p.ulysses,
                 f"only used with parallel.strategy=usp (strategy is '{p.strategy}')")


def _check_strategy_splits(recipe: Recipe, context: int,
                           device_count: int | None = None) -> None:
    """Strategy 'none' keeps whole sequences (context 1); every other one but auto splits
    them, so one chip in the context axis would make it a silent no-op."""
    for key, strategy in recipe.parallel.keyed_names():
        if strategy == "none":
            require(context == 1, "mesh.context", context,
                     f"{key} 'none' needs mesh.context = 1; pick a context-parallel "
                     f"strategy (all_gather, ulysses, ring, usp, auto)")
        elif strategy != "auto":
            seen = ("" if device_count is None else
                    f" (jax sees {device_count} device{'s' if device_count > 1 else ''}; on "
                    f"a machine without accelerators runtime.cpu_devices: 8 fakes eight)")
            require(context > 1, key, strategy,
                     f"splits the sequence over mesh.context, which is {context}{seen}; set "
                     f"mesh.context >= 2, or {key}=none")


def resolve_mesh(recipe: Recipe, device_count: int) -> dict[str, int]:
    """Mesh axis sizes with -1 filled in; checks the product against the devices."""
    sizes = recipe.mesh.axis_sizes()
    fixed = 1
    for size in sizes.values():
        fixed *= size if size > 0 else 1
    fill = [axis for axis, size in sizes.items() if size == -1]
    if fill:
        split = [axis for axis, size in sizes.items() if size > 1]
        require(device_count % fixed == 0, f"mesh.{fill[0]}", -1,
                 f"the other axes ({' x '.join(f'mesh.{axis}' for axis in split)}) multiply "
                 f"to {fixed}, which does not divide the {device_count} "
                 f"device{'s' if device_count > 1 else ''} jax sees; lower them to a product "
                 f"that divides {device_count}" + _one_device_fix(split, device_count))
        sizes[fill[0]] = device_count // fixed
    product = 1
    for size in sizes.values():
        product *= size
    require(product == device_count, "mesh", sizes,
             f"axis sizes multiply to {product} but there are {device_count} devices; "
             f"make the product {device_count} or set one axis to -1")
    return sizes


def _one_device_fix(split: list[str], device_count: int) -> str:
    """The settings that run the recipe on one device: every split axis 1, and no
    context-parallel strategy once the context axis is 1."""
    if device_count != 1:
        return ""
    sets = [f"--set mesh.{axis}=1" for axis in split]
    if "context" in split:
        sets.append("--set parallel.strategy=none")
    return ": " + " ".join(sets)


def stored_chunks(recipe: Recipe, context: int) -> int:
    """How many contiguous chunks of the original sequence the stored order is made of:
    2 * context when load-balanced (rank i holds chunks i and 2*context-1-i), else context."""
    return 2 * context if recipe.parallel.load_balance and context > 1 else context


def _check_dcn_divides(dcn: dict[str, int], sizes: dict[str, int]) -> None:
    for axis, degree in dcn.items():    # an axis still -1 is checked once it is resolved
        require(sizes[axis] == -1 or sizes[axis] % degree == 0, f"mesh.dcn_{axis}", degree,
                 f"must divide mesh.{axis} ({sizes[axis]}), the axis's total degree")


def _check_slices(recipe: Recipe, sizes: dict[str, int], device_count: int,
                  slices: int | None) -> None:
    """Only data and fsdp span slices: mesh.dcn_data x mesh.dcn_fsdp of them (the devices'
    own count, when known); context and tensor must fit inside one slice."""
    mesh = recipe.mesh
    require(slices in (None, mesh.slices), "mesh.dcn_data", mesh.dcn_data,
             f"the devices form {slices} slice(s) but mesh.dcn_data x mesh.dcn_fsdp = "
             f"{mesh.slices}; make the product {slices} (lctrain plan: --slices)")
    per_slice = device_count // mesh.slices
    key = "context" if per_slice % sizes["context"] else "tensor"
    require(per_slice % (sizes["context"] * sizes["tensor"]) == 0, f"mesh.{key}", sizes[key],
             f"mesh.context x mesh.tensor must fit inside one slice ({per_slice} devices): "
             f"they exchange activations (context: K/V) every layer, which across slices would "
             f"cross the data-center network (DCN), an order of magnitude slower than ICI; "
             f"spread the slices over mesh.dcn_data / mesh.dcn_fsdp")
    _check_dcn_divides(mesh.dcn_sizes(), sizes)


def check_against_devices(recipe: Recipe, device_count: int,
                          slices: int | None = None) -> dict[str, int]:
    """Checks that depend on the devices (their count; their slices when known); returns
    the resolved mesh axis sizes."""
    sizes = resolve_mesh(recipe, device_count)
    _check_slices(recipe, sizes, device_count, slices)
    d, t = recipe.data, recipe.train
    batch_shards = sizes["data"] * sizes["fsdp"]
    require(d.batch_size % (batch_shards * t.grad_accum_steps) == 0, "data.batch_size",
             d.batch_size, f"must be divisible by mesh.data * mesh.fsdp * "
                           f"train.grad_accum_steps = {batch_shards * t.grad_accum_steps}")
    context = sizes["context"]
    _check_strategy_splits(recipe, context, device_count)
    chunks = stored_chunks(recipe, context)
    for key, seq_len in (("data.seq_len", d.seq_len), ("eval.seq_len", recipe.eval.seq_len)):
        require(seq_len is None or seq_len % chunks == 0, key, seq_len,
                 f"must be divisible by {chunks} (mesh.context={context}"
                 + (", x2 for parallel.load_balance" if chunks != context else "") + ")")
    m = recipe.model
    require(m.n_heads % sizes["tensor"] == 0 and m.n_kv_heads % sizes["tensor"] == 0,
             "mesh.tensor", sizes["tensor"],
             f"must divide model.n_heads ({m.n_heads}) and model.n_kv_heads ({m.n_kv_heads})")
    require(m.d_ff % sizes["tensor"] == 0, "mesh.tensor", sizes["tensor"],
             f"must divide model.d_ff ({m.d_ff})")
    return sizes
