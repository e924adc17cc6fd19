"""Writing a user's outputs without losing what was there.

A target that already holds something is refused unless the command was given
--overwrite, and then only the files the command writes are replaced: other files in an
output folder stay. What a run depends on (the pretrained model, the run dir, its data, its
tokenizer) is never a target, nor is a folder holding it. What is written goes to a new
name beside the target and is renamed into place only when complete: a crash while writing
leaves the old output whole, and no stale file of an earlier output of the same command
stays behind. No jax here: the CLI checks targets before jax starts.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from lctrain.recipes.schema import Recipe


class OutputError(ValueError):
    """An output target that would lose the user's files; names the target and the fix."""


def check_target(target: Path, overwrite: bool, option: str,
                 protected: dict[str, Path] | None = None, folder: bool = False) -> None:
    """`target` may be written: new, an empty folder, or `overwrite` is set; it is of the
    kind the command writes (a folder when `folder`, else a file), and it is none of
    `protected` ({what it is: path}) nor a folder holding one of them."""
    resolved = target.resolve()
    for what, path in (protected or {}).items():
        path = path.resolve()
        if resolved == path or resolved in path.parents:
            raise OutputError(
                f"{option} {target}: {'is' if resolved == path else 'holds'} {what} "
                f"({path}), which is never overwritten; give another "
                f"{'folder' if folder else 'path'}")
    exists = target.exists() or target.is_symlink()
    if exists and target.is_dir() != folder:
        # --overwrite replaces what the command writes: a folder for a file, or the other
        # way round, would remove something else.
        raise OutputError(f"{option} {target}: is a {'file' if folder else 'folder'}, and the "
                          f"command writes a {'folder' if folder else 'file'}; give another "
                          f"path")
    if overwrite or not exists:
        return
    if target.is_dir() and not any(target.iterdir()):
        return
    kind = "folder holds files" if target.is_dir() else "file exists"
    raise OutputError(f"{option} {target}: the {kind} already; give a new path, or "
                      f"--overwrite to replace {'its files' if folder else 'it'}")


@contextmanager
def replaced(target: Path) -> Iterator[Path]:
    """Yields a new file path beside `target` to write into; when the block ends normally
    it takes `target`'s place in one step, else it is removed and `target` stays as it was."""
    staging = _staging(target)
    staging.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield staging
    except BaseException:
        _remove(staging)
        raise
    os.replace(staging, target)


@contextmanager
def written_into(target: Path, owned: Callable[[str], bool]) -> Iterator[Path]:
    """Yields an empty folder beside `target` to write into. When the block ends normally
    its files move into `target` (the whole folder where `target` is new); there, the files
    `owned` claims (an earlier output of the same command) that were not written again are
    removed, and nothing else is touched. When it fails, `target` stays as it was."""
    staging = _staging(target)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        _remove(staging)
        raise
    if not target.exists():
        os.replace(staging, target)
        return
    written = {path.name for path in staging.iterdir()}
    for path in staging.iterdir():
        _remove(target / path.name)  # a folder of that name would block the rename
        os.replace(path, target / path.name)
    staging.rmdir()
    for path in target.iterdir():
        if path.is_file() and owned(path.name) and path.name not in written:
            path.unlink()


def _staging(target: Path) -> Path:
    staging = target.with_name(f".{target.name}.partial-{os.getpid()}")
    _remove(staging)
    return staging


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def kept_for_run(recipe: Recipe, run_dir: Path, model_dir: str | None,
                 tokenizer: str | None) -> dict[str, Path]:
    """What an output of a run's command (export, eval) must never write over: the run dir,
    the pretrained folder it began from (model_dir), the data it read and the folder of
    its tokenizer."""
    kept = {"the run dir": run_dir}
    if model_dir:
        kept["the run's model.init folder"] = Path(model_dir)
    data = recipe.data
    for i, spec in enumerate(data.sources):
        kept[f"the run's data.sources[{i}]"] = Path(spec.path)
    if not data.sources and data.source != "synthetic":
        kept["the run's data.source"] = Path(data.source)
    if recipe.eval.source not in (None, "synthetic"):
        kept["the run's eval.source"] = Path(recipe.eval.source)
    if tokenizer:
        folder = Path(tokenizer)
        kept["the run's tokenizer"] = folder if folder.is_dir() else folder.parent
    return kept
