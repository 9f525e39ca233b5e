"""Knee of a QPS-vs-load curve: where adding load stops buying throughput.

The guide's rule is the most negative second difference of QPS. Taken
literally it divides by load steps that can be zero (a repeated load),
treats a flat or falling curve as having a knee, and fires on noise. Here:
loads are sorted and repeats averaged (no zero steps); the curve is smoothed
(a 3-point running median, then mean) before differencing; the slope is
normalised by the curve's early slope, and a curve that never rose has no
knee; the slope must fall by `min_drop` of the early slope and stay down
(every later slope too); among such points the knee is the one with the
largest second difference.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import median
from typing import Any, Sequence


@dataclass(frozen=True, slots=True)
class Knee:
    """The knee: its load, the (measured) QPS there and how much of the early slope was lost."""
    index: int       # into the sorted, de-duplicated loads
    load: float
    qps: float
    drop: float      # 1 - slope after / slope before, normalised by the early slope

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _dedupe(loads: Sequence[float], qps: Sequence[float]) -> tuple[list[float], list[float]]:
    """Sort by load and average the QPS of repeated loads, so no load step is zero."""
    groups: dict[float, list[float]] = {}
    for x, y in zip(loads, qps):
        groups.setdefault(float(x), []).append(float(y))
    xs = sorted(groups)
    return xs, [sum(groups[x]) / len(groups[x]) for x in xs]


def smooth(values: Sequence[float]) -> list[float]:
    """A 3-point running median (kills single outliers), then, from 7 points on, a 3-point running
    mean (a short curve would lose its corner to it); ends kept."""
    v = list(values)
    if len(v) < 3:
        return v
    med = [v[0]] + [median(v[i - 1:i + 2]) for i in range(1, len(v) - 1)] + [v[-1]]
    if len(v) < 7:
        return med
    return [med[0]] + [sum(med[i - 1:i + 2]) / 3 for i in range(1, len(med) - 1)] + [med[-1]]


def find_knee(loads: Sequence[float], qps: Sequence[float], *, min_drop: float = 0.4, min_rise: float = 0.1,
              flat_tolerance: float = 1e-9) -> Knee | None:
    """The knee of QPS over load, or None: fewer than 3 distinct loads, a curve that never rose
    by `min_rise` of its peak (flat within noise, or falling: saturated before the first load),
    or no slope drop of `min_drop` that persists."""
    xs, ys = _dedupe(loads, qps)
    if len(xs) < 3:
        return None
    sm = smooth(ys)
    if max(sm) - sm[0] < min_rise * max(abs(y) for y in sm):
        return None            # flat within noise: already saturated at the smallest load
    slopes = [(sm[i + 1] - sm[i]) / (xs[i + 1] - xs[i]) for i in range(len(xs) - 1)]   # steps > 0 by dedupe
    early = max(slopes[0], (sm[-1] - sm[0]) / (xs[-1] - xs[0]))
    scale = max(abs(y) for y in sm) / (xs[-1] - xs[0])
    if early <= flat_tolerance * max(scale, 1.0) or early <= 0.05 * scale:
        return None            # it never rose: no denominator to normalise by, no knee
    low = (1 - min_drop) * early
    best: tuple[float, int] | None = None
    for i in range(1, len(slopes)):
        if any(s >= low for s in slopes[i:]):
            continue           # the slope is (or gets) back up: noise or a pause, not a knee
        second = (slopes[i - 1] - slopes[i]) / early      # the guide's second difference, normalised
        if second > 0 and (best is None or second > best[0]):
            best = (second, i)
    if best is None:
        return None
    i = best[1]
    drop = 1 - (sum(slopes[i:]) / len(slopes[i:])) / early
    return Knee(i, xs[i], ys[i], round(drop, 4))
