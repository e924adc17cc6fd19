"""The README is a guide that fits on a few screens, and nothing it or the guides point at
is missing: every relative link and every repository path in backticks exists."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md",
             *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("cli/", "trainer/", "parallel/", "kernels/", "recipes/", "tests/", "benchmarks/",
       "docs/", ".ci/")


def test_readme_is_at_most_300_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_path_named_exists(document):
    text = document.read_text()
    links = [link.split("#")[0] for link in re.findall(r"\]\(([^)\s]+)\)", text)
             if not link.startswith(("http", "#"))]
    missing = [link for link in links if not (document.parent / link).exists()]
    # `parallel/ring.py`, `recipes/tiny.yaml`, `tests/test_ring.py::name`: repository paths
    paths = [path.split("::")[0].rstrip("/.,:") for path in re.findall(r"`([^`\s]+)`", text)
             if path.startswith(TOP) and "*" not in path and "<" not in path]
    missing += [path for path in paths if not (ROOT / path).exists()
                and not (ROOT / module_file(path)).exists()]
    assert missing == []


def module_file(path: str) -> str:
    """`parallel/ring.DKV_TRANSPORT_DTYPE` names a module's attribute: parallel/ring.py."""
    folder, _, name = path.rpartition("/")
    return f"{folder}/{name.split('.')[0]}.py"
