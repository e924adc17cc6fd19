"""Progress for long work: a live rich display on a terminal, plain log lines in a pipe or
a file (where a redrawn bar would only add noise)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterable, Iterator, TypeVar

from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

T = TypeVar("T")


def live(console: Console | None) -> bool:
    """Whether `console` can redraw a bar in place."""
    return console is not None and console.is_terminal and not console.quiet


class Timing:
    """What `timed` prints when the work ends: `label`, then the elapsed time, or `outcome`
    where the work set one (a result read from a cache, a time measured elsewhere)."""

    def __init__(self, label: str):
        self.label, self.outcome = label, None


@contextmanager
def timed(console: Console | None, label: str) -> Iterator[Timing]:
    """A spinner while the work runs (terminal only), then one line with its duration."""
    start = time.perf_counter()
    timing = Timing(label)
    if live(console):
        with console.status(escape(label)):
            yield timing
    else:
        yield timing
    _done(console, timing.label, start, timing.outcome)


def tracked(console: Console | None, items: Iterable[T], label: str) -> Iterator[T]:
    """`items`, counted by a bar (terminal only), then one line with the duration."""
    items = list(items)
    with Bar(console, label, len(items)) as bar:
        for item in items:
            yield item
            bar.advance()


def _done(console: Console | None, label: str, start: float,
          outcome: str | None = None) -> None:
    if console is not None:
        console.print(f"{label}: {outcome or f'{time.perf_counter() - start:.1f} s'}",
                      markup=False, highlight=False, soft_wrap=True)


class Bar:
    """A bar of done items, with elapsed time, ETA and optional figures, drawn under the
    log lines (which keep printing above it) on a terminal; elsewhere nothing. With
    `summary`, leaving it prints one line with the duration either way."""

    def __init__(self, console: Console | None, label: str, total: int, done: int = 0,
                 summary: bool = True):
        self.console, self.label, self.summary = console, label, summary
        self.progress = None
        if live(console):
            self.progress = Progress(
                TextColumn(escape(label)), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                TextColumn("{task.fields[figures]}"), console=console, transient=True)
            self.task = self.progress.add_task(label, total=total, completed=done,
                                               figures="")

    def __enter__(self) -> "Bar":
        self.start = time.perf_counter()
        if self.progress:
            self.progress.start()
        return self

    def __exit__(self, error_type, *exc) -> None:
        if self.progress:
            self.progress.stop()
        if self.summary and error_type is None:
            _done(self.console, self.label, self.start)

    def advance(self, figures: str | None = None) -> None:
        if self.progress:
            update = {"figures": figures} if figures is not None else {}
            self.progress.update(self.task, advance=1, **update)
