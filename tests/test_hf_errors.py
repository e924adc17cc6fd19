"""Bad Hugging Face folders: one line naming the file or key, the value and the fix, exit 2,
before anything compiles."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from lctrain.cli.main import app
from lctrain.trainer.hf.safetensors_io import SafetensorsFolder, write_folder

from make_hf_model import make_hf_model


@pytest.fixture(scope="module")
def good_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("good")
    make_hf_model(folder)
    return folder


def copy_with(folder, target, *, config=None, drop=(), add=(), resize=None):
    """A copy of the model folder with config.json keys changed and tensors dropped,
    added (name, shape) or given another shape ({name: shape})."""
    target.mkdir()
    original = json.loads((folder / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**original, **(config or {})}))
    weights = SafetensorsFolder(folder)
    shapes = {name: entry.shape for name, entry in weights.entries.items() if name not in drop}
    shapes.update({name: tuple(shape) for name, shape in add})
    shapes.update(resize or {})

    def values(name):
        if name in weights.entries and weights.entries[name].shape == shapes[name]:
            return weights.read(name)
        return np.zeros(shapes[name], np.float32)

    write_folder(target, list(shapes.items()), np.dtype(np.float32), values)
    return target


def run_fails(folder, tmp_path, *sets):
    result = CliRunner().invoke(app, ["run", "--steps", "1", "--run-dir", str(tmp_path / "run"),
                                      "--set", f"model.init=hf:{folder}", *sets])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir())
    return lines[0]


def test_folder_without_config(tmp_path):
    line = run_fails(tmp_path, tmp_path)
    assert f"{tmp_path}/config.json: missing" in line


def test_folder_without_weights(tmp_path, good_model):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text((good_model / "config.json").read_text())
    line = run_fails(tmp_path / "model", tmp_path)
    assert "no *.safetensors weights" in line and "config.json" in line


def test_unsupported_architecture_is_named(tmp_path, good_model):
    folder = copy_with(good_model, tmp_path / "model",
                       config={"architectures": ["GPT2LMHeadModel"]})
    line = run_fails(folder, tmp_path)
    assert "architecture GPT2LMHeadModel is not supported" in line
    assert "LlamaForCausalLM" in line


def test_missing_tensor_is_named(tmp_path, good_model):
    folder = copy_with(good_model, tmp_path / "model",
                       drop=["model.layers.1.mlp.up_proj.weight"])
    assert "tensor model.layers.1.mlp.up_proj.weight is missing" in run_fails(folder, tmp_path)


def test_unexpected_tensor_is_named(tmp_path, good_model):
    folder = copy_with(good_model, tmp_path / "model",
                       add=[("model.layers.0.self_attn.q_proj.bias", (64,))])
    line = run_fails(folder, tmp_path)
    assert "unexpected tensor model.layers.0.self_attn.q_proj.bias" in line


def test_shape_mismatch_names_tensor_expected_and_got(tmp_path, good_model):
    folder = copy_with(good_model, tmp_path / "model",
                       resize={"model.layers.0.mlp.down_proj.weight": (64, 128)})
    line = run_fails(folder, tmp_path)
    assert ("tensor model.layers.0.mlp.down_proj.weight has shape [64, 128], expected "
            "[64, 160]") in line


def test_recipe_key_disagreeing_with_config_names_both(tmp_path, good_model):
    line = run_fails(good_model, tmp_path, "--set", "model.layers=3")
    assert "'model.layers' = 3 disagrees with" in line and "config.json (2)" in line


def test_rope_keys_may_differ_on_purpose(good_model):
    from lctrain.recipes import load_recipe

    recipe = load_recipe("tiny", [f"model.init=hf:{good_model}", "model.rope_theta=1e6",
                                "model.rope_scaling={type: linear, factor: 4}"])
    assert recipe.model.rope_theta == 1e6 and recipe.model.rope_scaling.type == "linear"


def truncated_copy(folder, target, cut_bytes=100):
    """The model folder with its weight file cut short in the data (the header intact)."""
    import shutil

    shutil.copytree(folder, target)
    weights = target / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(raw[:len(raw) - cut_bytes])
    return target


def test_weights_cut_short_in_their_data_name_file_and_tensor(tmp_path, good_model):
    folder = truncated_copy(good_model, tmp_path / "model")
    line = run_fails(folder, tmp_path)
    assert f"{folder}/model.safetensors: tensor " in line
    assert "past the file's end" in line and "re-download" in line


def test_eval_of_weights_cut_short_is_one_line(tmp_path, good_model):
    folder = truncated_copy(good_model, tmp_path / "model")
    result = CliRunner().invoke(app, ["eval", "--run-dir", str(tmp_path / "none"),
                                      "--set", f"model.init=hf:{folder}"])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "model.safetensors: tensor " in lines[0] and "cut short" in lines[0]


def test_tensor_whose_byte_range_disagrees_with_its_shape_is_named(tmp_path, good_model):
    import struct

    folder = truncated_copy(good_model, tmp_path / "model", cut_bytes=0)
    weights = folder / "model.safetensors"
    raw = weights.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + length])
    name = "model.norm.weight"
    header[name]["shape"] = [header[name]["shape"][0] // 2]
    encoded = json.dumps(header, separators=(",", ":")).encode()
    assert len(encoded) <= length
    encoded += b" " * (length - len(encoded))
    weights.write_bytes(raw[:8] + encoded + raw[8 + length:])
    line = run_fails(folder, tmp_path)
    assert f"tensor {name} spans 256 bytes, but its shape [32] in F32 needs 128" in line


def test_a_scaling_factor_without_a_type_on_an_unscaled_model_is_refused(tmp_path, good_model):
    """config.json has no rope_scaling: a factor alone would train (and export) at the old
    RoPE without a word."""
    line = run_fails(good_model, tmp_path, "--set", "model.rope_scaling={factor: 4}")
    assert "'model.rope_scaling.factor' = 4 is not used by model.rope_scaling.type 'none'" in line
    assert "set model.rope_scaling.type to linear, llama3 or yarn" in line


@pytest.mark.parametrize("key, value", [("rope_scaling", {"factor": 4.0}),
                                        ("rope_parameters", {"rope_theta": 1e4, "factor": 4.0})])
def test_a_config_json_scaling_factor_without_a_type_is_refused(tmp_path, good_model, key,
                                                                value):
    folder = copy_with(good_model, tmp_path / "model", config={key: value, "rope_scaling":
                                                               value if key == "rope_scaling"
                                                               else None})
    line = run_fails(folder, tmp_path)
    assert f"config.json: {key} gives factor 4.0 but no rope_type" in line
    assert f"add \"rope_type\" (linear, llama3 or yarn) to {key}, or remove factor" in line
