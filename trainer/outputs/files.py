"""Writing a user's outputs without losing what was there.

A target that already holds something is refused unless the command was given
--overwrite, and folders the user's run depends on (the pretrained model, the run dir) are
never targets. What is written goes to a new name beside the target and is renamed into
place only when complete: a crash leaves the old output or the new one, never half of each,
and no stale file of an earlier output stays behind. No jax here: the CLI checks targets
before jax starts.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import yaml


class OutputError(ValueError):
    """An output target that would lose the user's files; names the target and the fix."""


def check_target(target: Path, overwrite: bool, option: str,
                 protected: dict[str, Path] | None = None) -> None:
    """`target` may be written: new, an empty folder, or `overwrite` is set; and it is none
    of `protected` ({what it is: folder}) nor a folder holding one of them."""
    resolved = target.resolve()
    for what, folder in (protected or {}).items():
        folder = folder.resolve()
        if resolved == folder or resolved in folder.parents:
            raise OutputError(
                f"{option} {target}: {'is' if resolved == folder else 'holds'} {what} "
                f"({folder}), which is never overwritten; give another folder")
    if overwrite or not (target.exists() or target.is_symlink()):
        return
    if target.is_dir() and not any(target.iterdir()):
        return
    kind = "folder holds files" if target.is_dir() else "file exists"
    raise OutputError(f"{option} {target}: the {kind} already; give a new path, or "
                      f"--overwrite to replace it")


@contextmanager
def replaced(target: Path, folder: bool) -> Iterator[Path]:
    """Yields a new path beside `target` (an empty folder when `folder`) to write into; when
    the block ends normally it takes `target`'s place, else it is removed and `target` stays
    as it was."""
    staging = target.with_name(f".{target.name}.partial-{os.getpid()}")
    _remove(staging)
    if folder:
        staging.mkdir(parents=True)
    else:
        staging.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield staging
    except BaseException:
        _remove(staging)
        raise
    put_in_place(staging, target)


def put_in_place(staging: Path, target: Path) -> None:
    """Renames `staging` to `target`. A file replaces a file in one step; a folder cannot,
    so the old one is first renamed aside and removed only once the new one is in place."""
    if (target.exists() or target.is_symlink()) and (staging.is_dir() or target.is_dir()):
        aside = target.with_name(f".{target.name}.old-{os.getpid()}")
        _remove(aside)
        os.replace(target, aside)
        os.replace(staging, target)
        _remove(aside)
    else:
        os.replace(staging, target)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def kept_by_export(run_dir: Path, tokenizer: str | None) -> dict[str, Path]:
    """What `lctrain export` must never write over: the run dir, the pretrained folder the
    run began from (model.init=hf:<dir> in its recipe.yaml) and the folder of the tokenizer
    it copies."""
    kept = {"the run dir": run_dir}
    model = (yaml.safe_load((run_dir / "recipe.yaml").read_text()) or {}).get("model") or {}
    init = str(model.get("init", "random"))
    if init.startswith("hf:"):
        kept["the run's model.init folder"] = Path(init[3:])
    if tokenizer:
        folder = Path(tokenizer)
        kept["the run's tokenizer"] = folder if folder.is_dir() else folder.parent
    return kept
