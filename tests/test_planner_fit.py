"""The estimate's fit rule against what the compiler for one v5e chip accepts
(benchmarks/data/tpu_v5e_2026-12-07_fits.json: the AOT compile for v5e:1x1 gives the chip's
own figures), and the TPU's lane padding of heads narrower than 128."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lctrain.parallel.chips import chip_named
from lctrain.parallel.planner import search
from lctrain.parallel.planner.estimate import estimate
from lctrain.recipes import load_recipe

ROOT = Path(__file__).resolve().parent.parent
FITS = json.loads((ROOT / "benchmarks" / "data" / "tpu_v5e_2026-12-07_fits.json").read_text())
EDGES = FITS["compiled_edges_v5e_1x1"]["edges"]
ONE_CHIP = dict(data=1, fsdp=1, context=1, tensor=1)
# issue 47: the estimate within 10% of the longest length that runs
BELOW_LONGEST_RUN = 0.9


def longest_run(edge: dict) -> int:
    """The longest length of the edge's recipe that ran on the chip; its longest compile
    for the chip where it has not run (every accepted compile tried there ran)."""
    return max((row["seq_len"] for row in FITS["max_seq_ran"]["rows"]
                if row["remat"] == edge["remat"] and row["ran"]), default=edge["accepted"])


@pytest.mark.parametrize("edge", EDGES, ids=[edge["remat"] for edge in EDGES])
def test_estimated_max_seq_stays_under_what_the_chips_compiler_refuses(edge):
    recipe = load_recipe(str(ROOT / "recipes" / "one_chip.yaml"), edge["sets"])
    longest = search.max_seq_len(recipe, ONE_CHIP, chip_named("v5e"), "none")
    assert BELOW_LONGEST_RUN * longest_run(edge) <= longest < edge["refused"]
    assert longest <= edge["accepted"]


def test_the_plan_warns_where_offloading_the_attentions_output_outruns_the_estimate():
    """An offloaded context has peaked at the estimate itself (calibration.json's note)."""
    from lctrain.parallel.planner.accuracy import estimate_note
    one_chip = str(ROOT / "recipes" / "one_chip.yaml")
    for sets in ([], ["remat.layers_per_checkpoint=2"]):
        assert "context: offload" in (estimate_note(load_recipe(one_chip, sets), ONE_CHIP) or "")
    kept = load_recipe(one_chip, ["remat.tensors={decoder_layer_input: offload}"])
    assert "context: offload" not in (estimate_note(kept, ONE_CHIP) or "")


@pytest.mark.parametrize("impl, padded", [("pallas", 2.0), ("xla", 1.0)])
def test_heads_of_64_take_the_bytes_of_heads_of_128_in_the_pallas_kernels(impl, padded):
    """16 heads of 64 and 8 of 128 have the same bytes; a TPU lays the Pallas kernels'
    [heads, tokens, head_dim] tensors out in 128 lanes, so the first take twice theirs (to
    the per-head logsumexps, which twice the heads also double)."""
    def attention_bytes(heads: int, head_dim: int) -> float:
        recipe = load_recipe("tiny", [
            "model.d_model=1024", f"model.n_heads={heads}", f"model.n_kv_heads={heads // 2}",
            f"model.head_dim={head_dim}", "model.dtype=bfloat16", "data.seq_len=8192",
            "data.batch_size=1", "mesh.data=1", "mesh.context=1", f"attention.impl={impl}"])
        return estimate(recipe, ONE_CHIP, chip_named("v5e"), "none").memory["attention"]

    assert attention_bytes(16, 64) == pytest.approx(padded * attention_bytes(8, 128), rel=1e-3)


def test_each_phases_share_is_the_highest_measured_in_it_rounded_up():
    """calibration.json's fit shares are its measured points' (a phase where no point
    peaks takes the highest of its kind; a refused program counts at the least share it
    can have; an offloaded context is outside the fit; programs in groups of layers are a
    kind of their own): none is typed apart from its evidence."""
    from lctrain.parallel.planner.calibration import calibration
    shares = calibration()["peak_share"]
    points = [p for p in shares["measured"]["points"] if not p.get("context_offloaded")]

    for key, share in shares["by_peak_phase"].items():
        phase = key.removesuffix("_in_groups")
        kind = [p for p in points if p.get("in_groups", False) == (key != phase)]
        in_phase = [p for p in kind if p["peak_phase"] == phase] or kind
        assert share == math.ceil(max(p["share"] for p in in_phase) * 100) / 100, key
    for refused in (p for p in points if p.get("refused")):
        assert refused["share"] == round(refused["peak_gb_at_least"] / refused["estimate_gb"], 3)
