"""Measured figures have one home: benchmarks/RESULTS.md and the data files
(benchmarks/data/*.json, parallel/planner/calibration.json). Code, tests, recipes and the
guides say how things work and link there; a figure those homes own, written again into a
.py file, a recipe, docs/ or the README, fails here. The owned figures are read from the homes themselves, not
kept by hand: decimal figures with four or more significant digits ("76.19", "3.1995"),
and shorter ones with their unit ("17.1%", "0.76x", "1.1 GB")."""

import json
import re
from pathlib import Path

import pytest

from lctrain.parallel import chips

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
DATA = [*sorted((ROOT / "benchmarks" / "data").glob("*.json")),
        ROOT / "parallel" / "planner" / "calibration.json"]
FOLDERS = ("cli", "trainer", "parallel", "kernels", "recipes", "tests")
SCANNED = sorted({*(path for folder in FOLDERS for path in (ROOT / folder).rglob("*.py")),
                  *(ROOT / "benchmarks").glob("*.py"), *(ROOT / "recipes").glob("*.yaml"),
                  *(ROOT / "docs").glob("*.md"), ROOT / "README.md"}
                 - {Path(__file__).resolve()})  # its examples are figures
# A decimal or thousands-grouped number standing alone: not part of 0.10.2, a name, a path
# or a format ("{x:>7.1%}"), nor glued to a letter that is no unit (XLA's "97.06G" quoted).
NUMBER = r"(?<![\w.,/\->:<^])(\d+\.\d+|\d{1,3}(?:,\d{3})+)(?!\d|\.\d|,\d)"
UNITS = ("GiB", "GB", "MiB", "MB", "TFLOP/s", "%", "x", "ms", "s")
UNIT = r"(?: ?(" + "|".join(re.escape(unit) for unit in UNITS) + r"))?(?![\w/])"
# Versions and what commands set (`--set data.seq_len=131072`) are not measurements.
NOT_MEASURED = (re.compile(r"`[^`]*`"),
                re.compile(r"\b(?:Python|jax|jaxlib|libtpu|pytest|torch) \d+\.\d+"))


def significant_digits(number: str) -> int:
    return len(number.replace(",", "").replace(".", "").lstrip("0"))


def figures_in(text: str) -> set[tuple[str, str]]:
    """(number, unit) of each figure in `text`; unit "" for numbers precise enough to be
    told apart without one. Grouped thousands count only as a percentage (65,536 is a
    length a recipe sets)."""
    for pattern in NOT_MEASURED:
        text = pattern.sub(" ", text)
    found = set()
    for match in re.finditer(NUMBER + UNIT, text):
        number, unit = match.group(1), match.group(2) or ""
        if "," in number and unit != "%":
            continue
        if significant_digits(number) >= 4:
            found.add((number, ""))
        elif unit:
            found.add((number, unit))
    return found


def texts_in(value) -> list[str]:
    """A JSON document's prose (strings with a space: not versions or names) and its
    decimal numbers, as text."""
    if isinstance(value, dict):
        return [text for item in value.values() for text in texts_in(item)]
    if isinstance(value, list):
        return [text for item in value for text in texts_in(item)]
    if isinstance(value, str):
        return [value] if " " in value else []
    return [json.dumps(value)] if isinstance(value, float) else []


def chip_specifications() -> set[tuple[str, str]]:
    """The chips' HBM as parallel/chips.py defines it (a data sheet's figure or what the
    runtime hands out), in GB and GiB: a specification code may state."""
    return {(f"{chip.hbm_bytes / scale:.2f}", "") for chip in chips.CHIPS.values()
            for scale in (1e9, 2**30)}


def owned_figures() -> set[tuple[str, str]]:
    texts = [RESULTS.read_text(),
             *(text for path in DATA for text in texts_in(json.loads(path.read_text())))]
    return {figure for text in texts for figure in figures_in(text)} - chip_specifications()


OWNED = owned_figures()


def restated(text: str) -> list[str]:
    """The owned figures `text` writes, each once."""
    return sorted(f"{number} {unit}".strip() for number, unit in figures_in(text) & OWNED)


def test_the_homes_own_figures():
    """The extraction finds RESULTS.md's and calibration.json's figures (else the scan
    below proves nothing), and leaves out the chips' specifications."""
    assert ("76.19", "") in OWNED and ("9.6", "%") in OWNED
    assert ("6.031", "") in OWNED  # a fitted copy count: calibration.json's
    assert ("102.80", "") not in OWNED  # v5p's HBM


def test_figures_are_found_as_written():
    assert figures_in("needed 83.71 GB, 9.6% and 0.76x, at 65,536 tokens, MFU 261,743%, "
                      "17.1 GB") == {("83.71", ""), ("9.6", "%"), ("0.76", "x"),
                                     ("261,743", ""), ("17.1", "GB")}  # 4+ digits: bare
    assert figures_in("jax 0.10.2, libtpu 0.0.42.1, Python 3.11, `--set x=12.5`, "
                      "f\"{x:>11.1f} {y:.1%}\", v5p:2x2x1, 33.5M tokens, \"Used 97.24G\", "
                      "17.1 apart") == set()


def scanned_case(path: Path):
    return pytest.param(path, id=str(path.relative_to(ROOT)))


@pytest.mark.parametrize("path", [scanned_case(path) for path in SCANNED])
def test_no_owned_figure_outside_its_home(path):
    assert restated(path.read_text()) == [], (
        f"{path.relative_to(ROOT)} restates measured figures: link to benchmarks/RESULTS.md "
        f"(or read the data file) instead")
