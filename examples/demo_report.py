"""What the examples show a person: progress, a summary table, a plot of curves against time.

Progress is a tqdm bar on a terminal and plain periodic lines otherwise (a log, CI, a pipe): no escape codes
end up in files. The plot needs matplotlib (an example dependency, never one of a pc package's).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["Progress", "print_table", "save_plot"]

LINES_PER_RUN = 5  # plain progress lines per run when stderr is not a terminal


class Progress:
    """A tqdm bar when stderr is a terminal; else a plain line every ``total / LINES_PER_RUN`` updates.

    Args:
        desc: The label (``"worker 1"``).
        total: Number of updates expected.
        position: The bar's line (one per process).
        enabled: False shows nothing at all.
    """

    def __init__(self, desc: str, total: int, position: int = 0, enabled: bool = True) -> None:
        self.desc, self.total, self.count = desc, total, 0
        self.every = max(1, total // LINES_PER_RUN)
        self._bar: Any = None
        self._plain = enabled and not sys.stderr.isatty()
        if enabled and not self._plain:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, position=position, leave=True, dynamic_ncols=True)

    def update(self, loss: float) -> None:
        """One step done, with its loss."""
        self.count += 1
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            self._bar.update(1)
        elif self._plain and (self.count % self.every == 0 or self.count == self.total):
            print(
                f"{self.desc}: step {self.count}/{self.total}, loss {loss:.3f}", file=sys.stderr, flush=True
            )

    def close(self) -> None:
        """Finish the bar (nothing for plain lines)."""
        if self._bar is not None:
            self._bar.close()


def print_table(rows: Sequence[tuple[str, str]]) -> None:
    """Two aligned columns."""
    width = max(len(name) for name, _ in rows)
    print("\n" + "\n".join(f"{name:<{width}}  {value}" for name, value in rows), flush=True)


def save_plot(path: str, curves: dict[str, list[tuple[float, float, float]]]) -> str:
    """Accuracy and loss against time, a line per curve of ``(seconds, loss, accuracy)``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for label, points in curves.items():
        seconds = [p[0] for p in points]
        style = "--" if "baseline" in label else "-"
        acc_ax.plot(seconds, [p[2] for p in points], style, label=label)
        loss_ax.plot(seconds, [p[1] for p in points], style, label=label)
    acc_ax.set(title="held-out accuracy (batch statistics)", xlabel="seconds", ylabel="accuracy", ylim=(0, 1))
    loss_ax.set(title="training loss", xlabel="seconds", ylabel="cross-entropy", yscale="log")
    acc_ax.legend(loc="lower right")
    loss_ax.legend(loc="upper right")
    fig.suptitle("pc demo on handwritten digits: asynchronous workers vs a single process")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return os.path.abspath(path)
