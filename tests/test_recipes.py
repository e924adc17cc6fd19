"""Recipe loading: types, overrides, presets and every error a user can make."""

import dataclasses
import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from lctrain.cli.main import app
from lctrain.recipes import RecipeError, check_against_devices, load_recipe
from lctrain.recipes.schema import LayerGroupConfig, SourceConfig
from lctrain.trainer.data.checks import check_data

from make_hf_model import LLAMA31_8B_CONFIG


def write(tmp_path, text):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


def test_default_recipe_fills_the_tiny_preset():
    recipe = load_recipe("tiny")
    assert (recipe.model.layers, recipe.model.d_model, recipe.model.n_heads,
            recipe.model.n_kv_heads, recipe.model.vocab) == (2, 128, 8, 2, 128)
    assert recipe.runtime.cpu_devices == "auto"


def test_preset_values_are_overridden_field_by_field():
    recipe = load_recipe("tiny", ["model.preset=llama3.1-8b", "model.layers=4"])
    assert recipe.model.layers == 4
    assert recipe.model.d_model == 4096 and recipe.model.n_kv_heads == 8
    assert recipe.model.vocab == 128256 and recipe.model.rope_scaling.factor == 8.0


def test_warmup_longer_than_the_run_is_clamped():
    from lctrain.trainer.state.optimizer import learning_rate_schedule

    train = load_recipe("tiny", ["train.steps=3", "train.warmup_steps=20"]).train
    assert train.run_warmup_steps == 2
    assert float(learning_rate_schedule(train)(2)) == pytest.approx(train.lr)


def test_overrides_convert_types():
    recipe = load_recipe("tiny", ["train.lr=3e-4", "data.seq_len=512", "parallel.load_balance=false",
                                "remat.policy=custom", "remat.tensors.decoder_layer_input=offload"])
    assert recipe.train.lr == pytest.approx(3e-4)
    assert recipe.data.seq_len == 512
    assert recipe.parallel.load_balance is False
    assert recipe.remat.tensors == {"decoder_layer_input": "offload"}


@pytest.mark.parametrize("overrides, key, words", [
    (["train.stpes=3"], "train.stpes", "unknown recipe key"),
    (["data.seq_len=abc"], "data.seq_len", "expected an integer"),
    (["data.seq_len=2.5"], "data.seq_len", "expected an integer"),
    (["parallel.strategy=zigzag"], "parallel.strategy", "allowed: none, all_gather"),
    (["model.n_kv_heads=3"], "model.n_kv_heads", "must divide model.n_heads"),
    (["mesh.data=-1", "mesh.fsdp=-1"], "mesh.fsdp", "only one mesh axis may be -1"),
    (["mesh.context=2"], "mesh.context", "needs mesh.context = 1"),
    (["remat.tensors.decoder_layer_input=offload"], "remat.tensors", "only used with"),
    (["remat.policy=custom", "remat.tensors.attn=offload"], "remat.tensors.attn",
     "unknown tensor name"),
    (["data.source=/no/such/file.bin"], "data.source", "no such file"),
    (["runtime.cpu_devices=many"], "runtime.cpu_devices", "expected an integer or 'auto'"),
    (["runtime.cpu_devices=-1"], "runtime.cpu_devices", "must be >= 0 (0 = jax's default) or auto"),
    (["train.warmup_steps=-1"], "train.warmup_steps", "must be >= 0"),
])
def test_bad_values_name_the_key_and_the_fix(overrides, key, words):
    with pytest.raises(RecipeError) as err:
        check_data(load_recipe("tiny", overrides))
    assert f"'{key}'" in str(err.value) and words in str(err.value)


@pytest.mark.parametrize("scaling, key, readers", [
    ("{factor: 4}", "factor", "linear, llama3 or yarn"),
    ("{type: none, factor: 4}", "factor", "linear, llama3 or yarn"),
    ("{type: linear, factor: 4, beta_fast: 16}", "beta_fast", "yarn"),
    ("{type: yarn, factor: 4, low_freq_factor: 2}", "low_freq_factor", "llama3"),
])
def test_rope_scaling_keys_the_type_does_not_read_are_refused(scaling, key, readers):
    with pytest.raises(RecipeError) as err:
        load_recipe("tiny", [f"model.rope_scaling={scaling}"])
    message = str(err.value)
    assert f"'model.rope_scaling.{key}'" in message and "model.rope_scaling.type" in message
    assert f"set model.rope_scaling.type to {readers}" in message


def test_rope_scaling_keys_merge_over_the_preset_type():
    scaling = load_recipe("tiny", ["model.preset=llama3.1-8b",
                                 "model.rope_scaling={factor: 128}"]).model.rope_scaling
    assert (scaling.type, scaling.factor, scaling.original_max_position_embeddings) == (
        "llama3", 128.0, 8192)


@pytest.mark.parametrize("scaling", ["{type: none}", "{type: linear, factor: 4}",
                                     "{type: yarn, factor: 8, beta_fast: 16}"])
def test_a_written_recipe_loads_back_with_the_same_rope(tmp_path, scaling):
    from lctrain.recipes import load_run_recipe

    recipe = load_recipe("tiny", [f"model.rope_scaling={scaling}"])
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    assert load_run_recipe(tmp_path).model.rope_scaling == recipe.model.rope_scaling


def test_a_run_dir_recipe_listing_every_rope_key_still_loads(tmp_path):
    """recipe.yaml written before unread rope_scaling keys were refused lists them all."""
    from lctrain.recipes import load_run_recipe

    recipe = load_recipe("tiny")
    raw = recipe.to_dict()
    raw["model"]["rope_scaling"] = dataclasses.asdict(recipe.model.rope_scaling)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    assert load_run_recipe(tmp_path).model.rope_scaling.type == "none"


def test_unknown_section_in_file(tmp_path):
    with pytest.raises(RecipeError, match="unknown recipe key 'trainer'"):
        load_recipe(write(tmp_path, "trainer:\n  steps: 3\n"))


def test_yaml_scalars_are_checked(tmp_path):
    with pytest.raises(RecipeError, match=r"'train.steps': got 'ten' \(str\)"):
        load_recipe(write(tmp_path, "train:\n  steps: ten\n"))


def test_mesh_product_must_match_devices():
    recipe = load_recipe("tiny", ["mesh.data=2", "mesh.fsdp=2"])
    with pytest.raises(RecipeError, match="multiply to 4 but there are 8 devices"):
        check_against_devices(recipe, 8)


def test_fill_axis_takes_the_remaining_devices():
    recipe = load_recipe("tiny", ["mesh.data=-1", "mesh.tensor=2"])
    assert check_against_devices(recipe, 8) == {"data": 4, "fsdp": 1, "context": 1, "tensor": 2}


def test_seq_len_must_split_into_load_balanced_chunks():
    recipe = load_recipe("tiny", ["parallel.strategy=all_gather", "mesh.context=4",
                                "data.seq_len=100"])
    with pytest.raises(RecipeError, match=r"'data.seq_len' = 100: must be divisible by 8"):
        check_against_devices(recipe, 8)


def test_batch_must_split_over_data_parallel_devices():
    recipe = load_recipe("tiny", ["data.batch_size=4"])
    with pytest.raises(RecipeError, match="'data.batch_size' = 4: must be divisible by"):
        check_against_devices(recipe, 8)


@pytest.mark.parametrize("args, words", [
    (["run", "--set", "train.stpes=3"], "unknown recipe key 'train.stpes'"),
    (["run", "--set", "data.seq_len=abc"], "'data.seq_len': got 'abc'"),
    (["run", "tiny", "--set", "mesh.data=3"], "multiply to 3 but there are 8 devices"),
    (["run", "tiny", "--set", "mesh.context=2"], "needs mesh.context = 1"),
    (["run", "tiny", "--set", "parallel.strategy=ring"], "set mesh.context >= 2, or parallel.strategy=none"),
    (["run", "tiny", "--set", "data.batch_size=4"], "'data.batch_size' = 4: must be divisible by mesh.data"),
    (["run", "no-such-recipe.yaml"], "does not exist"),
])
def test_cli_reports_bad_input_in_one_line_and_exits_2(args, words, tmp_path):
    result = CliRunner().invoke(app, [*args, "--run-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0]


def test_readme_recipe_reference_is_current():
    from lctrain.recipes.reference import recipe_reference

    from lctrain.recipes.reference import embedded_reference

    guide = (Path(__file__).parents[1] / "docs" / "recipes.md").read_text()
    assert embedded_reference(guide) == recipe_reference(), (
        "run: python -m lctrain.recipes.reference docs/recipes.md")


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "recipes").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_recipes_load_with_every_value_they_set(path, tmp_path):
    # A recipe that imports a model gets Llama 3.1 8B's config.json (no weights are read)
    # and synthetic data in place of the folders it names.
    stand_ins = {"model": {"init": f"hf:{tmp_path}"}, "data": {"source": "synthetic"}}
    (tmp_path / "config.json").write_text(json.dumps(LLAMA31_8B_CONFIG))
    written = yaml.safe_load(path.read_text())
    imports = written["model"].get("init", "random").startswith("hf:")
    mixes = "sources" in written.get("data", {})  # its files are the user's to make
    recipe = load_recipe(str(path), ["model.init=hf:" + str(tmp_path), "data.source=synthetic"]
                         if imports else [])
    if not mixes:
        check_data(recipe)
    for section, values in written.items():
        for key, value in values.items():
            if imports and key in stand_ins.get(section, {}):
                continue
            if key == "sources":
                value = [SourceConfig(**source) for source in value]
            if key == "layer_pattern":
                value = [LayerGroupConfig(**group) for group in value]
            if isinstance(value, dict) and key == "rope_scaling":
                assert all(getattr(recipe.model.rope_scaling, k) == v for k, v in value.items())
                continue
            assert getattr(getattr(recipe, section), key) == value, f"{section}.{key}"


def test_llama31_8b_preset_equals_the_hub_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA31_8B_CONFIG))
    imported = load_recipe("tiny", [f"model.init=hf:{tmp_path}"]).model
    preset = load_recipe("tiny", ["model.preset=llama3.1-8b"]).model
    differing = [f.name for f in dataclasses.fields(preset)
                 if getattr(preset, f.name) != getattr(imported, f.name)]
    assert differing == ["init", "preset"]


def test_cpu_devices_is_a_count_or_auto():
    assert load_recipe("tiny", ["runtime.cpu_devices=4"]).runtime.cpu_devices == 4
    assert load_recipe("tiny", ["runtime.cpu_devices=0"]).runtime.cpu_devices == 0
    assert load_recipe("tiny", ["runtime.cpu_devices=auto"]).runtime.cpu_devices == "auto"


@pytest.mark.parametrize("strategy", ["all_gather", "ulysses", "ring", "usp"])
def test_a_splitting_strategy_without_a_context_axis_is_refused(strategy):
    """mesh.context 1 (the default) with a strategy that splits the sequence used to run as
    if parallel.strategy were none; now one line names both keys and the fix."""
    with pytest.raises(RecipeError) as err:
        load_recipe("tiny", [f"parallel.strategy={strategy}"])
    assert str(err.value) == (
        f"recipe key 'parallel.strategy' = '{strategy}': splits the sequence over "
        f"mesh.context, which is 1; set mesh.context >= 2, or parallel.strategy=none")


def test_a_context_axis_filled_to_one_device_is_refused_too():
    recipe = load_recipe("tiny", ["parallel.strategy=ring", "mesh.context=-1", "mesh.data=1"])
    with pytest.raises(RecipeError, match="'parallel.strategy' = 'ring'.*which is 1"):
        check_against_devices(recipe, 1)
    assert check_against_devices(recipe, 4)["context"] == 4


def test_auto_with_one_context_device_still_loads():
    recipe = load_recipe("tiny", ["parallel.strategy=auto"])
    assert check_against_devices(recipe, 8) == {"data": 8, "fsdp": 1, "context": 1, "tensor": 1}


PALLAS_8000 = ["attention.impl=pallas", "parallel.strategy=ring", "mesh.context=4",
               "data.seq_len=8000"]


def test_pallas_tiles_are_checked_at_load_for_tpu():
    """Ring on 4 chips at 8000 tokens: 2000-token kernel calls, which Mosaic cannot tile
    (no multiple of 128 divides 2000, and it exceeds a block); the strategy's check refuses
    it in one line, as splash's layout is, where the trace used to raise a bare ValueError."""
    from lctrain.parallel import STRATEGIES

    recipe = load_recipe("tiny", PALLAS_8000)
    sizes = check_against_devices(recipe, 8)
    with pytest.raises(RecipeError) as err:
        STRATEGIES["ring"].check(recipe, sizes, "tpu")
    assert str(err.value) == (
        "recipe key 'attention.impl' = 'pallas': each kernel call on TPU takes 2000 queries x "
        "2000 keys (data.seq_len 8000, mesh.context 4), and the Pallas TPU kernel needs a "
        "sequence length that is a multiple of 128 (or at most the block size 512); got 2000; "
        "make data.seq_len a multiple of 512, or use attention.impl=xla")
    # impl=auto falls back from splash (1000-token chunks) to the same Pallas kernel.
    auto = load_recipe("tiny", [*PALLAS_8000, "attention.impl=auto"])
    with pytest.raises(RecipeError, match="'attention.impl' = 'auto'"):
        STRATEGIES["ring"].check(auto, sizes, "tpu")
    # all_gather's calls are 2000 queries x 8000 keys: the same fix.
    gather = load_recipe("tiny", [*PALLAS_8000, "parallel.strategy=all_gather"])
    with pytest.raises(RecipeError, match="2000 queries x 8000 keys.*multiple of 512"):
        STRATEGIES["all_gather"].check(gather, sizes, "tpu")
    # What the message asks for works, and interpret mode (CPU) tiles any length.
    STRATEGIES["ring"].check(load_recipe("tiny", [*PALLAS_8000, "data.seq_len=8192"]), sizes, "tpu")
    STRATEGIES["ring"].check(recipe, sizes, "cpu")


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="TPU AOT compiles need libtpu (the tpu extra)")
def test_pallas_tiles_stop_a_tpu_compile_before_it_starts(monkeypatch):
    """The path `lctrain plan --compile` and a TPU run take: mesh_for on 4 v5p chips raises
    the RecipeError before anything is traced (jax.jit is never reached)."""
    import jax

    from lctrain.parallel import aot
    from lctrain.trainer.state import build
    from lctrain.trainer.state.build import mesh_for

    recipe = load_recipe("tiny", [*PALLAS_8000, "mesh.data=1", "data.batch_size=1"])
    devices = aot.topology_devices("v5p:2x2x1")
    monkeypatch.setattr(jax, "jit", lambda *a, **k: pytest.fail("jit before the check"))
    with pytest.raises(RecipeError, match="'attention.impl' = 'pallas'.*multiple of 512"):
        build.compile_train_step(recipe, devices)
    assert mesh_for(load_recipe("tiny", [*PALLAS_8000, "mesh.data=1", "data.batch_size=1",
                                       "data.seq_len=8192"]), devices).shape["context"] == 4


def test_relative_sources_are_taken_from_the_working_directory(tmp_path, monkeypatch):
    from lctrain.trainer.outputs.failures import DataError
    from lctrain.trainer.data.sources import make_source

    (tmp_path / "data").mkdir()
    np.save(tmp_path / "data" / "tokens.npy", np.arange(1000, dtype=np.int32) % 100)
    monkeypatch.chdir(tmp_path)
    recipe = check_data(load_recipe("tiny", ["data.source=data/tokens.npy"]))
    assert make_source(recipe.data, vocab=128, seed=0).batch(0).inputs.shape == (8, 256)
    missing = tmp_path / "data" / "missing.bin"
    with pytest.raises(RecipeError) as err:
        check_data(load_recipe("tiny", ["data.source=data/missing.bin"]))
    assert f"'data.source' = 'data/missing.bin': no such file or folder (looked for {missing}" \
        in str(err.value)
    with pytest.raises(DataError, match=f"looked for {re.escape(str(missing))}"):
        make_source(dataclasses.replace(recipe.data, source="data/missing.bin"), vocab=128,
                    seed=0)


RECIPES = sorted((Path(__file__).parents[1] / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_memory_figures_in_recipes_agree_with_the_results(path):
    """A figure re-measured in a recipe's comments and not in benchmarks/RESULTS.md or the
    guides fails here: every 'NN.NN GB' a recipe states must be one they state."""
    root = Path(__file__).parents[1]
    documents = " ".join(p.read_text() for p in [root / "benchmarks" / "RESULTS.md",
                                                  *(root / "docs").glob("*.md")])
    figures = re.findall(r"\b\d+\.\d\d GB\b", path.read_text())
    assert [f for f in figures if f not in documents] == []


def test_the_default_recipe_splits_each_sequence_over_four_devices():
    recipe = load_recipe(None)
    assert (recipe.parallel.strategy, recipe.parallel.load_balance) == ("ring", True)
    assert check_against_devices(recipe, 8) == {"data": 2, "fsdp": 1, "context": 4, "tensor": 1}


def test_a_model_whose_shape_differs_from_its_preset_is_named_custom():
    """Logs name the preset only for its own shape; RoPE changes (context extension) keep it."""
    assert load_recipe("tiny").model.name == "tiny"
    assert load_recipe("tiny", ["model.rope_theta=500000"]).model.name == "tiny"
    assert load_recipe("tiny", ["model.layers=3"]).model.name == "custom (from tiny)"
    assert load_recipe("tiny", ["model.head_dim=32"]).model.name == "custom (from tiny)"


def test_nothing_writes_into_a_loaded_recipe():
    """Resolve once (#49): a recipe is frozen, every section of it; what a run resolves
    (auto's strategy, a fallback kernel) is a new recipe made with dataclasses.replace."""
    recipe = load_recipe("tiny", ["parallel.strategy=auto"])
    for section in dataclasses.fields(recipe):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(recipe, section.name, getattr(recipe, section.name))
        part = getattr(recipe, section.name)
        key = dataclasses.fields(part)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(part, key, getattr(part, key))
    for part, key in ((recipe.model.rope_scaling, "factor"), (LayerGroupConfig(), "count"),
                      (SourceConfig(), "path")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(part, key, getattr(part, key))
    ring = dataclasses.replace(recipe, parallel=dataclasses.replace(recipe.parallel,
                                                                     strategy="ring"))
    assert (recipe.parallel.strategy, ring.parallel.strategy) == ("auto", "ring")
