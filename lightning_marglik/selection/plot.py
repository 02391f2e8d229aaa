"""``evidence.png``: the candidates' evidence against their first test metric, labels placed apart."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

from .metrics import default_metrics

__all__ = ["Plotted", "label_points", "plot_evidence"]


class Plotted(Protocol):
    """What the plot reads of a candidate's result (a :class:`~.results.CandidateResult`, which writes the plot)."""

    name: str
    marglik: float
    n_params: int
    metrics: Dict[str, float]
    settings: Dict[str, Any]


def plot_evidence(results: Sequence[Plotted], path: str, higher_is_better: Mapping[str, bool]) -> None:
    """Evidence against the first test metric; marker size by parameter count, colour by class."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plotting is an extra: pip install lightning_marglik[examples]
        return
    metric = next(iter(results[0].metrics))
    shown = [r for r in results if metric in r.metrics and math.isfinite(r.marglik)]
    if not shown:
        return
    biggest = max(r.n_params for r in shown)
    kinds = [str((r.settings.get("candidate") or {}).get("class_path", "")).rpartition(".")[2] for r in shown]
    sizes = [20 + 200 * r.n_params / biggest for r in shown]
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for i, kind in enumerate(dict.fromkeys(kinds)):
        group = [(r, size) for r, k, size in zip(shown, kinds, sizes) if k == kind]
        ax.scatter([r.marglik for r, _ in group], [r.metrics[metric] for r, _ in group], s=[s for _, s in group],
                   color=f"C{i}", alpha=0.7, label=kind or None)
    if any(kinds):
        ax.legend(fontsize=8, title="class", title_fontsize=8)
    known = {name: m.higher_is_better for name, m in default_metrics(2).items()}  # e.g. all candidates reused
    better = higher_is_better.get(metric, known.get(metric))
    direction = {True: " (higher is better)", False: " (lower is better)"}.get(better, "")
    ax.set_xlabel("log evidence / N, training data only (higher is better)")
    ax.set_ylabel(f"test {metric}{direction}")
    ax.set_title("Model selection by the evidence (marker size: #params)")
    ax.margins(0.15)
    fig.tight_layout()
    label_points(ax, [(r.marglik, r.metrics[metric]) for r in shown], [r.name for r in shown], sizes)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def label_points(ax: Any, points: Sequence[Tuple[float, float]], labels: Sequence[str], sizes: Sequence[float]) -> None:
    """Label scatter points so that no label covers another label or a marker.

    Greedy: each label tries offsets in 8 directions at growing distances and takes the first
    free place (or, if there is none, the least covered one); labels away from their point get a
    thin leader line.

    Args:
        ax: A matplotlib ``Axes`` with the points already drawn and its limits set.
        points: Data coordinates of the points.
        labels: One label per point.
        sizes: Marker areas in points² (``scatter``'s ``s``).
    """
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

    fig = ax.figure
    fig.canvas.draw()  # settles the axis limits, so that data map to their final pixels
    renderer = fig.canvas.get_renderer()
    pixels = fig.dpi / 72.0
    radii = [math.sqrt(s) / 2 for s in sizes]  # marker radius in points
    markers = [Bbox.from_bounds(x - r * pixels, y - r * pixels, 2 * r * pixels, 2 * r * pixels)
               for (x, y), r in zip(ax.transData.transform(points), radii)]
    frame = ax.get_window_extent(renderer)
    legend = ax.get_legend()
    placed: List[Any] = [legend.get_window_extent(renderer)] if legend is not None else []

    def cost(box: Any) -> float:
        # Covering another label is worst, then leaving the axes, then covering a marker.
        return (100 * sum(_overlap(box, other) for other in placed)
                + 3 * (box.width * box.height - _overlap(box, frame))
                + sum(_overlap(box, other) for other in markers))

    directions = [(1, 1), (1, -1), (-1, 1), (-1, -1), (1, 0), (-1, 0), (0, 1), (0, -1)]
    order = sorted(range(len(points)), key=lambda i: (points[i][1], points[i][0]), reverse=True)
    for i in order:
        best: Optional[Tuple[float, Any, Any]] = None
        for distance in (3, 10, 18, 28, 40, 55):
            for dx, dy in directions:
                offset = (dx * (distance + radii[i]), dy * (distance + radii[i]))
                text = ax.annotate(
                    labels[i], points[i], xytext=offset, textcoords="offset points", fontsize=7,
                    ha={1: "left", -1: "right", 0: "center"}[dx], va={1: "bottom", -1: "top", 0: "center"}[dy],
                    arrowprops=dict(arrowstyle="-", lw=0.5, color="0.5", shrinkB=radii[i]) if distance > 3 else None,
                )
                text.update_positions(renderer)
                box = Text.get_window_extent(text, renderer).expanded(1.05, 1.2)  # the text, not its leader line
                score = cost(box)
                if best is None or score < best[0]:
                    if best is not None:
                        best[1].remove()
                    best = (score, text, box)
                else:
                    text.remove()
                if score == 0:
                    break
            if best is not None and best[0] == 0:
                break
        assert best is not None
        placed.append(best[2])


def _overlap(a: Any, b: Any) -> float:
    width = min(a.x1, b.x1) - max(a.x0, b.x0)
    height = min(a.y1, b.y1) - max(a.y0, b.y0)
    return width * height if width > 0 and height > 0 else 0.0
