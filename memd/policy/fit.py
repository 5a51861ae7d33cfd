"""A job's memory curve, peak(batch) = fixed + per_sample x batch, learned from its reports.

The fitted line is deliberately an *upper* bound: the batch it allows is safe, not merely
likely. Three ideas make it so:
- one report (b, p) with nothing else known bounds per_sample by p / b (fixed >= 0), so
  b_max = b x budget / p is provably safe and is the natural second point;
- with two or more batch sizes the slope is raised by two standard errors (noise assumed
  ``noise`` x peak unless repeated reports at one batch show the actual spread), and the
  intercept is lifted until every observed point lies under the line;
- per batch size, an isolated allocator spike (far above the others) is ignored once enough
  reports exist; repeated spikes are believed.
A prior (from the job's hints, via the estimators) is used only until reports exist, and the
controller never jumps on a prior alone.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

NOISE = 0.02  # assumed relative noise of one peak report before the job shows its own
Z = 2.0  # standard errors added to the slope
PRIOR_POINTS = 3  # weight of the assumed noise against the residuals the job shows


@dataclass(frozen=True)
class Observation:
    batch: int
    peak_bytes: int
    base_bytes: Optional[int] = None  # memory held between steps (weights, optimizer), if known


@dataclass(frozen=True)
class Curve:
    fixed_bytes: float
    per_sample_bytes: float
    source: str  # "prior", "bound" (one batch size seen), "fit" (two or more)
    batch_sizes: int  # distinct batch sizes observed
    confidence: float  # 0..1: grows with distinct batch sizes and their spread
    # (batch, highest credible report x (1 + 2 noise)) per observed batch size, ascending: what
    # was seen beats what the line extrapolates, for that batch and (peaks grow with the
    # batch) every smaller one.
    observed: Tuple[Tuple[int, float], ...] = ()

    def peak(self, batch: int) -> float:
        line = self.fixed_bytes + self.per_sample_bytes * batch
        for seen, bound in self.observed:
            if seen >= batch:
                return min(line, min(b for s, b in self.observed if s >= batch))
        return line

    def max_batch(self, budget_bytes: float) -> int:
        """The largest batch whose predicted peak fits ``budget_bytes`` (0 when none does)."""
        room = budget_bytes - self.fixed_bytes
        if room < 0:
            fits = 0
        elif self.per_sample_bytes <= 0:
            fits = 1 << 20
        else:
            fits = int(math.floor(room / self.per_sample_bytes + 1e-9))
        seen = [s for s, bound in self.observed if bound <= budget_bytes and s > fits]
        return max(seen + [fits])


@dataclass(frozen=True)
class Prior:
    fixed_bytes: int
    per_sample_bytes: int
    source: str = "hints"


def fit(observations: Sequence[Observation], prior: Optional[Prior] = None, noise: float = NOISE) -> Optional[Curve]:
    points = aggregate(observations)
    if not points:
        if prior is None:
            return None
        return Curve(float(prior.fixed_bytes), float(prior.per_sample_bytes), "prior", 0, 0.0)
    base = _base(observations)
    if len(points) == 1:
        curve = _one_point(points[0], base, prior)
    else:
        curve = _line(_without_spiked_batch(points, noise), base, noise)
    # A report can sit noise below the truth and the next one noise above it: 2 x noise.
    return replace(curve, observed=tuple((b, top * (1 + 2 * noise)) for b, top, _, _ in points))


def aggregate(observations: Iterable[Observation]) -> List[Tuple[int, float, Optional[float], int]]:
    """(batch, robust peak, relative spread or None, reports) per batch size, ascending by batch."""
    by_batch: Dict[int, List[int]] = {}
    for obs in observations:
        if obs.batch >= 1 and obs.peak_bytes > 0:
            by_batch.setdefault(obs.batch, []).append(obs.peak_bytes)
    points = []
    for batch in sorted(by_batch):
        peaks = _without_isolated_spike(by_batch[batch])
        top = float(max(peaks))
        # The relative spread of repeated reports; None until there are enough to tell.
        spread = (statistics.pstdev(peaks) / statistics.mean(peaks)) if len(peaks) >= 3 else None
        points.append((batch, top, spread, len(peaks)))
    return points


def _without_isolated_spike(peaks: List[int]) -> List[int]:
    """Drop the single largest report when it stands far above an otherwise tight cluster
    (two or more reports that agree); two high reports are believed."""
    if len(peaks) < 3:
        return peaks
    ordered = sorted(peaks)
    rest = ordered[:-1]
    median = statistics.median(rest)
    mad = statistics.median(abs(p - median) for p in rest)
    if ordered[-1] > median + max(8 * mad, 0.05 * median) and ordered[-2] <= median + max(4 * mad, 0.02 * median):
        return rest
    return peaks


def _without_spiked_batch(points, noise: float = NOISE):
    """Drop one batch size whose only report stands far above the line the others draw.

    A lone report cannot be checked against its own batch size; against four or more others it
    can. If the batch was not a spike, the next report at it is high again, and two reports at
    one batch size are always believed, so a real cost is dropped at most once.
    """
    if len(points) < 4:
        return points
    worst, worst_excess = None, 0.0
    scale = max(p[1] for p in points)  # judged against the largest peak: what planning risks
    for i, (x, y, _, count) in enumerate(points):
        if count != 1:
            continue
        others = points[:i] + points[i + 1:]
        line = _ols([p[0] for p in others], [p[1] for p in others])
        if line is None:
            continue
        residuals = [abs(p[1] - (line[0] + line[1] * p[0])) / scale for p in others]
        excess = (y - (line[0] + line[1] * x)) / scale
        # Far from the others the line itself is uncertain: widen the band with the leverage.
        xs = [p[0] for p in others]
        mx = sum(xs) / len(xs)
        leverage = math.sqrt(1 + 1 / len(xs) + (x - mx) ** 2 / sum((v - mx) ** 2 for v in xs))
        band = max(0.05, 4 * max(residuals), 2 * noise * leverage)
        # The others must agree with their own line (within a few %) for it to judge this one.
        if max(residuals) <= 0.03 and excess > band and excess > worst_excess:
            worst, worst_excess = i, excess
    return points if worst is None else points[:worst] + points[worst + 1:]


def _ols(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def _base(observations: Sequence[Observation]) -> Optional[float]:
    bases = [o.base_bytes for o in observations if o.base_bytes is not None and o.base_bytes > 0]
    return float(min(bases)) if bases else None


def _one_point(point: Tuple[int, float, Optional[float], int], base: Optional[float], prior: Optional[Prior]) -> Curve:
    batch, peak, _, _ = point
    if base is not None and base < peak:
        # Memory held between steps is batch-independent, so (peak - base) / b bounds per_sample.
        return Curve(base, (peak - base) / batch, "bound", 1, 0.5)
    if prior is not None and 0 < prior.per_sample_bytes * batch < peak:
        return Curve(peak - prior.per_sample_bytes * batch, float(prior.per_sample_bytes), "prior", 1, 0.3)
    return Curve(0.0, peak / batch, "bound", 1, 0.25)


def _line(points: List[Tuple[int, float, Optional[float], int]], base: Optional[float], noise: float) -> Curve:
    xs = [float(p[0]) for p in points]
    ys = [p[1] for p in points]
    n = len(points)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    # Noise per report: what repeated reports showed, else the assumed level.
    seen = [p[2] for p in points if p[2] is not None]
    rel = max(seen + [noise / 10]) if seen else noise
    sigma = rel * my
    if n > 2:
        # The assumed noise counts as PRIOR_POINTS residuals; the job's own scatter takes over
        # as it reports more batch sizes (never below a tenth of the assumed level).
        residual2 = sum((y - (my + slope * (x - mx))) ** 2 for x, y in zip(xs, ys))
        sigma = max(math.sqrt((PRIOR_POINTS * sigma ** 2 + residual2) / (PRIOR_POINTS + n - 2)), sigma / 10)
    se = sigma / math.sqrt(sxx)
    upper = max(0.0, slope) + Z * se
    if base is not None:
        # Between-step memory bounds per_sample from above at every observed batch.
        upper = min(upper, max(((y - base) / x for x, y in zip(xs, ys))))
        upper = max(upper, 0.0)
    fixed = max(y - upper * x for x, y in zip(xs, ys))
    # The share of the slope we are sure of: 1 when the data pin it down, 0 when noise dominates.
    confidence = max(0.0, min(1.0, slope / upper)) if upper > 0 else 1.0
    return Curve(max(fixed, 0.0), upper, "fit", n, round(confidence, 3))
