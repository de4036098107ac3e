"""Progress of the long steps of a build, a merge or an embedding run: a tqdm bar on stderr when it is a
terminal (or when asked for), and the same figures to a callback (a collection's info shows a merge's)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

from tqdm import tqdm

# on_progress(step, done, total): called as a step starts (done 0) and as it advances.
OnProgress = Callable[[str, int, int], None]


def bars_wanted(progress: bool | None) -> bool:
    """Whether to draw bars: as asked, or with progress None, when stderr is a terminal."""
    if progress is None:
        return bool(getattr(sys.stderr, "isatty", lambda: False)())
    return progress


class Progress:
    def __init__(self, progress: bool | None = None, on_progress: OnProgress | None = None):
        self.bars = bars_wanted(progress)
        self.on_progress = on_progress

    @contextlib.contextmanager
    def step(self, name: str, total: int, unit: str = "vec") -> Iterator[Callable[[int], None]]:
        """A step of `total` units of work; yields update(n), to call as n more are done."""
        done = 0

        def update(n: int) -> None:
            nonlocal done
            done += n
            bar.update(n)
            if self.on_progress is not None:
                self.on_progress(name, done, total)

        with tqdm(total=total, desc=name, unit=unit, disable=not self.bars, leave=False, dynamic_ncols=True) as bar:
            if self.on_progress is not None:
                self.on_progress(name, 0, total)
            yield update
            # The step's last state drawn before the bar is cleared (leave=False): tqdm draws at most every
            # 0.1 s, so a step whose last update came sooner after the previous draw would never show its end.
            bar.refresh()
