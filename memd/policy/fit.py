"""A job's memory curve, peak(batch) = fixed + per_sample x batch, learned from its reports.

The predicted peak is deliberately an *upper* bound: the batch it allows is safe, not merely
likely. What makes it so (docs/policy.md gives the measurements behind each):
- a session's first step is a warm-up (optimizers allocate their state on it): never fitted
  once a later report exists; the first step after a change of batch only until a later one at
  that batch;
- one report (b, p) with nothing else known bounds per_sample by p / b (fixed >= 0), so
  b_max = b x budget / p is provably safe and is the natural second point;
- with two or more batch sizes, a least-squares line through each batch size's median report
  (weighted by its reports), raised by the headroom one step needs above it and widened by the
  line's confidence band, Z x sigma x sqrt(1/W + (b - mean)^2 / Sxx) (sigma: an assumed 2 %
  blended with the scatter the job shows); the headroom is the larger of the excess the job
  showed and the spread assumed until it shows its own within one stay at a batch size
  (assumed_spread, shown_spread);
- what was seen beats what the line extrapolates: the highest report at a batch size (plus
  twice the spread) bounds the peak at that batch and every smaller one, and a batch whose
  highest report plus the spread fits the budget is kept;
- where an overshoot kills (``kills``: host or unified memory) no report is forgiven and the
  highest seen floors the prediction; on a GPU an isolated allocator spike (far above the
  others at one batch size) is ignored once enough reports exist, repeated spikes believed.
A prior (from the job's hints, via the estimators) is used only until reports exist, and the
controller never jumps on a prior alone.
"""
from __future__ import annotations

import collections
import functools
import itertools
import math
import operator
import statistics
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from .frozen import evolve

NOISE = 0.02  # assumed relative noise of one peak report before the job shows its own
Z = 2.0  # standard errors of the fitted line added to the prediction
PRIOR_POINTS = 3  # weight of the assumed noise against the residuals the job shows
HIGH = 0.9  # the quantile of a step's excess over the middle line that the headroom covers
# The assumed spread gives way to what the job shows: at most SHOWN_K times the widest range
# of its reports at one batch size (once SHOWN reports there). Never fading by count alone: a
# peak's upper mode comes in streaks (a real job was killed after 5 low reports at one batch;
# its tail stood 1.4x, another's 1.8x, the range the reports had shown by then).
SHOWN, SHOWN_K = 3, 2.0
# Points memoised (point): a session holds at most 64 batch sizes (sessions.HISTORY) and a
# daemon 256 sessions; fewer, and a round of decisions over every session would evict each
# session's points before its next decision.
POINTS_KEPT = 1 << 14
LOCAL = 2.0  # the headroom is measured at the batch sizes within this factor of the largest
# Real curves bend, and planning extrapolates from the largest batch: once the batch sizes
# within LOCAL of it span at least this factor (three or more of them), the line is theirs.
SPAN = 1.3


@dataclass(frozen=True, slots=True)  # slots: a daemon keeps 64 a session, 16,384 at the cap, read at each fit
class Observation:
    batch: int
    peak_bytes: int
    # Memory held between steps (weights, optimizer), if known, in the peaks' units: a base at or
    # above the lowest report cannot be, and is ignored (_base).
    base_bytes: Optional[int] = None
    # A session's first step: optimizers allocate their state on it (AdamW: twice the trained
    # parameters), so its peak may be far below the job's. Never fitted once a later one exists.
    warmup: bool = False
    # The first step at a batch size after a change: the allocator meets new sizes (on the CPU
    # it ran 40-70 MiB low, then steady). Fitted only until a later report at its batch exists.
    settling: bool = False


@dataclass(frozen=True)
class Curve:
    fixed_bytes: float
    per_sample_bytes: float
    source: str  # "prior", "bound" (one batch size seen), "fit" (two or more); "remembered" (planner.curve_for)
    batch_sizes: int  # distinct batch sizes observed
    confidence: float  # 0..1: grows with distinct batch sizes and their spread
    # (batch, highest credible report) per observed batch size, ascending: what was seen beats
    # what the line extrapolates, for that batch and (peaks grow with the batch) every smaller one.
    observed: Tuple[Tuple[int, float], ...] = ()
    noise: float = NOISE  # relative noise of one report, as the fit assumed it
    # The fitted line's confidence band, (Z x sigma, reports, mean batch, Sxx): right of the mean
    # batch the prediction widens by Z sigma sqrt(1/n + (b - mean)^2 / Sxx); left of it the
    # band stays at its narrowest, so the prediction never falls as the batch grows.
    band: Tuple[float, int, float, float] = (0.0, 1, 0.0, 0.0)
    cap: Optional[Tuple[float, float]] = None  # (fixed, per_sample) of a line known to lie above
    # (batch, fixed, per_sample): a line drawn near the largest batch (SPAN) falls, left of the
    # batch sizes it was drawn through, no faster than the line through all of them, nor below
    # it (up to its own value at the first of them).
    left: Optional[Tuple[int, float, float]] = None
    # An overshoot is a kill (host RAM, unified memory), not a catchable error: a peak seen at a
    # batch, or at a smaller one, is a floor for the prediction there, never forgiven as a spike.
    kills: bool = False
    # Where an overshoot kills: (b1, top1, b2, top2), the two largest batch sizes seen and their
    # highest reports; past b2 a plan's prediction is no lower than a convex curve through them
    # would reach (upper, convex_past). None before two batch sizes.
    beyond: Optional[Tuple[int, float, int, float]] = None

    def line(self, batch: float) -> float:
        zs, n, mean, sxx = self.band
        wider = zs * math.sqrt(1 / n + (max(0.0, batch - mean) ** 2 / sxx if sxx else 0.0)) if zs else 0.0
        line = self.fixed_bytes + self.per_sample_bytes * batch + wider
        if self.left is not None and batch < self.left[0]:
            start, fixed, per_sample = self.left
            at_start = self.line(start)
            # Falling from the window's first batch at the slope of all the batch sizes can pass
            # below the reports of the small ones when that slope is steeper than their truth (a
            # slope 3 % high, 92 samples left: 0.1 % under a batch of one's median report).
            line = max(line, min(at_start, max(at_start - per_sample * (start - batch), fixed + per_sample * batch)))
        return line if self.cap is None else min(line, self.cap[0] + self.cap[1] * batch)

    def peak(self, batch: int) -> float:
        """The predicted peak at ``batch``: the line, or the highest report at this batch or a
        larger one plus the noise, if lower; never below what was seen (floor). It fits a budget
        exactly when max_batch says the batch does (tests/test_invariants.py)."""
        seen = [top * (1 + self.noise) for s, top in self.observed if s >= batch]
        predicted = min([self.line(batch)] + seen)
        return max(predicted, self.floor(batch))

    def upper(self, batch: int) -> float:
        """The predicted peak a plan is held to (invariants.py): ``peak``, and past the largest
        batch seen where an overshoot kills, no lower than a convex curve through the largest
        measured steps would reach (convex_past)."""
        predicted = self.peak(batch)
        if self.beyond is not None and batch > self.beyond[2]:
            predicted = max(predicted, convex_past(self.beyond, batch, self.noise))
        return predicted

    def safe_batch(self, budget_bytes: float) -> int:
        """The largest batch whose ``upper`` fits ``budget_bytes``: max_batch, and past the largest
        batch seen (where an overshoot kills) no further than the convex bound allows."""
        fits = self.max_batch(budget_bytes)
        beyond = self.beyond
        if beyond is None or fits <= beyond[2]:
            return fits
        ran = beyond[2]
        proven = largest(lambda b: b <= ran or convex_past(beyond, b, self.noise) <= budget_bytes, near=ran)
        return max(ran if self.peak(ran) <= budget_bytes else 0, min(fits, proven))

    def floor(self, batch: int) -> float:
        """What a step at ``batch`` has been seen to reach (0 unless ``kills``): peaks grow with
        the batch, so the highest report at this batch or any smaller one."""
        if not self.kills:
            return 0.0
        return max([top for s, top in self.observed if s <= batch], default=0.0)

    def max_batch(self, budget_bytes: float) -> int:
        """The largest batch whose predicted peak fits ``budget_bytes`` (0 when none does). A
        batch whose highest report, plus the noise, fits is kept whatever the line says: the
        budget already keeps a margin free, and the line may be unsure of a slope that the noise
        hides."""
        # Both line and floor grow with the batch (their slopes are >= 0), so the search may
        # start where the line alone meets the budget: a few steps, not twenty.
        fits = largest(lambda b: self.line(b) <= budget_bytes and self.floor(b) <= budget_bytes,
                       near=self._guess(budget_bytes))
        seen = [s for s, top in self.observed
                if top * (1 + self.noise) <= budget_bytes and s > fits and self.floor(s) <= budget_bytes]
        return max(seen + [fits])

    def _guess(self, budget_bytes: float) -> Optional[int]:
        """Where the line meets the budget, its band taken as it widens far right of the mean
        batch (Z sigma (b - mean) / sqrt(Sxx), which it stays above): max_batch's search starts
        there. Without the band, a line drawn through two batch sizes guessed 50 % high and the
        search took 16 evaluations of the line instead of 2 (a guess never moves the answer)."""
        zs, _, mean, sxx = self.band
        if zs and sxx:
            widening = zs / math.sqrt(sxx)
            return _meets(self.fixed_bytes - widening * mean, self.per_sample_bytes + widening, budget_bytes)
        return _meets(self.fixed_bytes, self.per_sample_bytes, budget_bytes)


LARGEST = 1 << 20  # no batch is larger


def convex_past(beyond: Tuple[int, float, int, float], batch: float, noise: float) -> float:
    """An upper bound, past the largest batch seen, on a peak that grows with the batch no faster
    than a quadratic with nonnegative terms (fixed + a b + q b^2: a model's activations are
    linear in the batch, a contrastive loss's logits b x b). From two batch sizes b1 < b2, such a
    curve rises past b2 by at most the slope between them times (b + b2) / (b1 + b2). A line
    through the two largest batch sizes of a quadratic job planned a batch whose step it could not
    hold (tests/test_invariants.py). From one batch size no slope is known: its peak as all per
    sample (a bound Curve) and max_growth stand for it, as a quadratic through the one peak held a
    job that started at batch 1 (0.24 GiB, mostly its framework) there for good."""
    b1, top1, b2, top2 = beyond
    slope = max(0.0, (top2 - top1) / (b2 - b1))
    return top2 * (1 + noise) + slope * (batch - b2) * (batch + b2) / (b1 + b2)


def _meets(fixed: float, per_sample: float, budget: float) -> Optional[int]:
    """Where fixed + per_sample x b meets ``budget``, within [1, LARGEST); None when it never does."""
    if not per_sample > 0:
        return None
    at = (budget - fixed) / per_sample
    return None if at != at else 1 if at < 1 else LARGEST - 1 if at >= LARGEST else int(at)  # at != at: NaN


def largest(ok: Callable[[int], bool], near: Optional[int] = None) -> int:
    """The largest b in [1, LARGEST] with ok(b), for ok true up to a point (0 when ok(1) fails).
    ``near``: a guess to search from (galloping out of it, then halving), the same answer in
    about 2 log2(distance) calls of ok instead of 21 where the guess is close."""
    if near is not None and 1 <= near < LARGEST:
        lo, hi = _bracket(ok, near)
        if lo == 0 or hi == LARGEST + 1:
            return lo if lo == 0 else LARGEST
    else:
        if not ok(1):
            return 0
        if ok(LARGEST):
            return LARGEST
        lo, hi = 1, LARGEST  # ok(lo), not ok(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _bracket(ok: Callable[[int], bool], near: int) -> Tuple[int, int]:
    """(lo, hi) around the edge of ok, out from ``near``: ok(lo) and not ok(hi), with lo 0 when
    ok(1) fails and hi LARGEST + 1 when ok(LARGEST) holds."""
    step = 1
    if ok(near):
        lo = near
        while True:
            hi = lo + step
            if hi >= LARGEST:
                return (LARGEST, LARGEST + 1) if ok(LARGEST) else (lo, LARGEST)
            if not ok(hi):
                return lo, hi
            lo, step = hi, step * 2
    hi = near
    while True:
        lo = hi - step
        if lo <= 1:
            return (1, hi) if ok(1) else (0, hi)
        if ok(lo):
            return lo, hi
        hi, step = lo, step * 2


@dataclass(frozen=True)
class Prior:
    fixed_bytes: int
    per_sample_bytes: int
    source: str = "hints"


def fit(observations: Sequence[Observation], prior: Optional[Prior] = None, noise: float = NOISE,
        kills: bool = False) -> Optional[Curve]:
    """The curve through ``observations``; ``kills``: an overshoot is a kill, so no report is
    forgiven as a spike and a seen peak floors the prediction (Curve.floor). A warm-up
    observation counts only while it is the only one: then nothing is fitted; a settling one
    only until a later report at its batch size exists."""
    by_batch, bases, stays = credible(observations, kills)
    keep = list if kills else _without_isolated_spike
    points = [point(batch, tuple(sorted(keep(by_batch[batch])))) for batch in sorted(by_batch)]
    if not points:
        if prior is None:
            return None
        return Curve(float(prior.fixed_bytes), float(prior.per_sample_bytes), "prior", 0, 0.0, kills=kills)
    base = float(min(bases)) if bases else None
    base = base if base is not None and base < min(p.peaks[0] for p in points) else None  # as _base
    noise = assumed_spread(shown_spread(stays, keep), noise)
    if len(points) == 1:
        curve = _one_point(points[0], base, prior)
    else:
        curve = _near_the_largest(points if kills else _without_spiked_batch(points, noise), base, noise,
                                  1.0 if kills else HIGH)
    observed = tuple([(p.batch, p.top) for p in points])
    beyond = observed[-2] + observed[-1] if kills and len(observed) > 1 else None
    return evolve(curve, observed=observed, noise=noise, kills=kills, beyond=beyond)


def credible(observations: Iterable[Observation],
             kills: bool = False) -> Tuple[Dict[int, List[int]], List[int], List[List[int]]]:
    """fit's reports in one pass over them: each batch size's credible peaks (in no particular
    order: fit sorts them), the positive bases of the reports kept (warm-ups out, settling ones
    out where their batch size has a settled report, unless, where an overshoot kills, one peaked
    above every settled report there: a step the job can take again) and each stay's settled
    peaks (shown_spread). fit once made five passes (the first two, then aggregate and _base),
    each reading every one of a session's 64 records. A job whose step one in twenty peaked
    higher took that step first at a new batch: dropped as a first step's (which runs low), it
    was forgotten, and the next one killed the job (bench/exam.py, tests/test_invariants.py)."""
    by_batch: Dict[int, List[int]] = {}  # every settled report's batch size, even one with no credible peak
    settling: List[Observation] = []
    bases: List[int] = []
    stays: List[List[int]] = []
    batch: Optional[int] = None
    stay: List[int] = []
    for obs in observations:
        if obs.batch != batch:  # any report at another batch size ends a stay, a warm-up's too
            batch, stay = obs.batch, []
            stays.append(stay)
        if obs.warmup:
            continue
        if obs.settling:
            settling.append(obs)
            continue
        peaks = by_batch.get(obs.batch)
        if peaks is None:
            peaks = by_batch[obs.batch] = []
        if obs.peak_bytes > 0:
            peaks.append(obs.peak_bytes)
            if obs.batch >= 1:
                stay.append(obs.peak_bytes)
        if obs.base_bytes is not None and obs.base_bytes > 0:
            bases.append(obs.base_bytes)
    unsettled: Dict[int, List[int]] = {}  # the settling reports at a batch size with no settled one
    tops = {b: max(peaks) for b, peaks in by_batch.items() if peaks} if kills else {}
    for obs in settling:
        if obs.batch in tops and obs.peak_bytes > tops[obs.batch]:
            by_batch[obs.batch].append(obs.peak_bytes)
            if obs.base_bytes is not None and obs.base_bytes > 0:
                bases.append(obs.base_bytes)
        if obs.batch not in by_batch:
            unsettled.setdefault(obs.batch, [])
            if obs.peak_bytes > 0:
                unsettled[obs.batch].append(obs.peak_bytes)
            if obs.base_bytes is not None and obs.base_bytes > 0:
                bases.append(obs.base_bytes)
    by_batch.update(unsettled)
    return {b: peaks for b, peaks in by_batch.items() if b >= 1 and peaks}, bases, stays


def assumed_spread(shown: Optional[float], noise: float) -> float:
    """The spread to assume above a step's typical peak: ``noise`` until the job shows its own
    (``shown``: shown_spread), then at most SHOWN_K times that."""
    return noise if shown is None else min(noise, SHOWN_K * shown)


def shown_spread(stays: Iterable[List[int]], keep: Callable[[List[int]], List[int]] = list) -> Optional[float]:
    """The widest range, relative to its median, of a job's settled reports within one stay at a
    batch size (``stays``: each one's peaks, its reports there with no other batch size between
    them; credible), over the stays of SHOWN reports or more; None before one has them.
    ``keep``: the reports of a stay believed.

    Across stays the job itself moves (its loader rebuilt, its heap's history): the four-workers
    job's steps at 118 peaked at 825.5 MiB 143 s into its run and at 834.9-835.9 MiB 750 s later,
    where no stay showed more than 0.2 %, and the 2 % spread drawn from the two cut it 118 -> 109
    -> 102 with its steps 8 MiB inside the budget. What a batch reached in any stay still floors
    its prediction where an overshoot kills (Curve.floor)."""
    shown = [_range(sorted(keep(peaks))) for peaks in stays if len(peaks) >= SHOWN]
    return max(shown) if shown else None


def _range(peaks: List[int]) -> float:
    """The range of ``peaks`` (ascending, positive) relative to their median."""
    return (peaks[-1] - peaks[0]) / statistics.median(peaks) if peaks else 0.0


class Point(NamedTuple):
    """One batch size's credible reports (ascending), with what every fit reads of them worked
    out once (point() makes one): a fit reads each batch size's median a dozen times."""
    batch: int
    peaks: Tuple[int, ...]
    middle: float  # the median report
    mean: float
    scatter: Tuple[float, ...]  # each report's squared distance from the mean, in order
    top: float  # the highest report (a field: a fit reads it a dozen times)


@functools.lru_cache(maxsize=POINTS_KEPT)
def point(batch: int, peaks: Tuple[int, ...]) -> Point:
    """A batch size's Point from its ``peaks``, sorted. Memoised: between two decisions of a job
    only the batch sizes it reported at since have new peaks, and a fit of 28 batch sizes spent
    a fifth of its time here."""
    mean = statistics.fmean(peaks)
    return Point(batch, peaks, float(statistics.median(peaks)), mean, tuple([(peak - mean) ** 2 for peak in peaks]),
                 float(peaks[-1]))


def aggregate(observations: Iterable[Observation], forgive_spikes: bool = True) -> List[Point]:
    """The credible reports per batch size, ascending by batch."""
    by_batch: Dict[int, List[int]] = collections.defaultdict(list)  # not setdefault's new list a report
    for obs in observations:
        if obs.batch >= 1 and obs.peak_bytes > 0:
            by_batch[obs.batch].append(obs.peak_bytes)
    keep = _without_isolated_spike if forgive_spikes else list
    return [point(batch, tuple(sorted(keep(by_batch[batch])))) for batch in sorted(by_batch)]


def _without_isolated_spike(peaks: List[int]) -> List[int]:
    """Drop the rare reports (from three reports on: one, later up to one in ten) that stand far
    above an otherwise tight cluster. Highs that recur more often than that are believed."""
    if len(peaks) < 3:
        return peaks
    ordered = sorted(peaks)
    allowed = max(1, len(peaks) // 10)
    rest = ordered[:-allowed]
    median = statistics.median(rest)
    mad = statistics.median(abs(p - median) for p in rest)
    if rest[-1] > median + max(4 * mad, 0.02 * median):
        return peaks  # the cluster itself is not tight
    kept = [p for p in ordered if p <= median + max(8 * mad, 0.05 * median)]
    return kept if len(kept) >= len(peaks) - allowed else peaks


def _without_spiked_batch(points: List[Point], noise: float = NOISE) -> List[Point]:
    """Drop one batch size whose only report stands far above the line the others draw.

    A lone report cannot be checked against its own batch size; against four or more others it
    can. If the batch was not a spike, the next report at it is high again, and two reports at
    one batch size are always believed, so a real cost is dropped at most once.
    """
    if len(points) < 4:
        return points
    worst, worst_excess = None, 0.0
    scale = max(p.top for p in points)  # judged against the largest peak: what planning risks
    for i, point in enumerate(points):
        if len(point.peaks) != 1:
            continue
        x, y = point.batch, point.top
        others = points[:i] + points[i + 1:]
        line = _ols([p.batch for p in others], [p.middle for p in others])
        if line is None:
            continue
        residuals = [abs(p.middle - (line[0] + line[1] * p.batch)) / scale for p in others]
        excess = (y - (line[0] + line[1] * x)) / scale
        # Far from the others the line itself is uncertain: widen the band with the leverage.
        xs = [p.batch for p in others]
        mx = sum(xs) / len(xs)
        leverage = math.sqrt(1 + 1 / len(xs) + (x - mx) ** 2 / sum((v - mx) ** 2 for v in xs))
        band = max(0.05, 4 * max(residuals), 2 * noise * leverage)
        # The others must agree with their own line (within a few %) for it to judge this one.
        if max(residuals) <= 0.03 and excess > band and excess > worst_excess:
            worst, worst_excess = i, excess
    return points if worst is None else points[:worst] + points[worst + 1:]


def excess_at(points: Sequence[Point], middles: Sequence[float], high: float) -> float:
    """The ``high`` quantile of the reports' excess over their batch size's ``middles`` (at least
    0). At the highest (``high`` 1, where an overshoot kills) over positive middles, that is the
    excess of each batch size's top report: peaks are sorted and dividing by a positive number
    keeps their order, so the same float comes without a quotient and a sort for every report
    (excess_sorted, the general way, gives it too)."""
    if high >= 1.0 and all(map(_ZERO.__lt__, middles)):
        # x - 1 keeps the order of x (rounding is monotone): the largest quotient less 1 is the
        # largest of the quotients less 1, without a generator over the batch sizes.
        highest: float = max(map(operator.truediv, map(_top, points), middles))
        return max(0.0, highest - 1)
    return excess_sorted(points, middles, high)


def excess_sorted(points: Sequence[Point], middles: Sequence[float], high: float) -> float:
    excess: List[float] = []
    for p, at in zip(points, middles):
        excess += [peak / at - 1 for peak in p.peaks]
    excess.sort()
    return max(0.0, excess[min(len(excess) - 1, int(high * len(excess)))])


def _ols(xs: Sequence[float], ys: Sequence[float]) -> Optional[Tuple[float, float]]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def _base(observations: Sequence[Observation], points: Sequence[Point]) -> Optional[float]:
    """The memory held between steps, or None when unknown or not in the reports' units.

    What a job holds between steps it also holds during every step, so a base at or above the
    lowest credible report cannot be in the same units as the peaks (the base counts the CUDA
    context or the whole process, the peaks only the allocator's tensors) and is ignored: taken
    as it is, (peak - base) / batch bounded the slope at 0 and a job whose reports (8, 20 GB),
    (16, 30 GB) came with a base of 40 GB was planned 1,048,576 where 36 fit 60 GB."""
    bases = [o.base_bytes for o in observations if o.base_bytes is not None and o.base_bytes > 0]
    if not bases or not points:
        return None
    base = float(min(bases))
    return base if base < min(p.peaks[0] for p in points) else None


def _one_point(point: Point, base: Optional[float], prior: Optional[Prior]) -> Curve:
    batch, peak = point.batch, point.top
    if base is not None and base < peak:
        # Memory held between steps is batch-independent, so (peak - base) / b bounds per_sample.
        return Curve(base, (peak - base) / batch, "bound", 1, 0.5)
    if prior is not None and 0 < prior.per_sample_bytes * batch < peak:
        return Curve(peak - prior.per_sample_bytes * batch, float(prior.per_sample_bytes), "prior", 1, 0.3)
    return Curve(0.0, peak / batch, "bound", 1, 0.25)


def _near_the_largest(points: List[Point], base: Optional[float], spread: float, high: float) -> Curve:
    """The line through the batch sizes near the largest once they pin a slope down, else
    through all of them. Drawn through all, the embedding row's line (0.41 MiB a sample from 256
    to 3480, 0.33 from 6501 to 8714) stood 150-180 MiB above the steps that ran at 9123-9465 in
    its 8 GiB group, and held the job at 92 % of the batch that fits."""
    near = _near(points)
    if len(near) < 3 or len(near) == len(points) or near[0].batch * SPAN > near[-1].batch:
        return _line(points, base, spread, high)
    return _line(near, base, spread, high, left=(near[0].batch,) + _raised(points, spread, high))


def _near(points: List[Point]) -> List[Point]:
    """The batch sizes within LOCAL of the largest: a tail of ``points``, which are ascending."""
    last, at = points[-1].batch, len(points)
    while at and points[at - 1].batch * LOCAL >= last:
        at -= 1
    return points[at:]


_middle, _peaks, _top = operator.attrgetter("middle"), operator.attrgetter("peaks"), operator.attrgetter("top")
_ZERO = 0.0
_TWOS = itertools.repeat(2)  # the exponent of each square in _line's sums


def _line(points: List[Point], base: Optional[float], spread: float, high: float = HIGH,
          left: Optional[Tuple[int, float, float]] = None) -> Curve:
    """The middle line through the batch sizes' median reports, raised by the headroom a step
    needs above it (a high quantile of the reports' excess, robust to rare spikes) and widened
    by the line's confidence band."""
    ys, ws, w, mx, my, dx, sxx, slope = _fitted(points)
    # Per-report noise: the assumed level counts as PRIOR_POINTS residuals; the job's own
    # scatter (the batch sizes' around the line, the reports' around their batch's) takes over
    # as it reports more, never below a tenth of the assumed level.
    residual2: float = sum(map(operator.mul, ws, map(pow, [y - (my + slope * d) for y, d in zip(ys, dx)], _TWOS)))
    residual2 += sum(itertools.chain.from_iterable(p.scatter for p in points))  # (peak - mean) ** 2, in order
    sigma = max(math.sqrt((PRIOR_POINTS * (NOISE * my) ** 2 + residual2) / (PRIOR_POINTS + w - 2)), NOISE * my / 10)
    se = sigma / math.sqrt(sxx)
    slope = max(0.0, slope)
    confidence = slope / (slope + Z * se) if slope + Z * se > 0 else 1.0  # 1 when the data pin the slope down
    headroom = _headroom(points, mx, my, slope, spread, high)
    cap = None
    if base is not None:
        # Memory held between steps is batch-independent: (peak - base) / batch bounds
        # per_sample at every observed batch, and so the line from the highest point.
        bound = max(0.0, max((p.top - base) / p.batch for p in points))
        cap = (max(p.top - bound * p.batch for p in points), bound)
    scale = 1 + headroom
    return Curve(max(0.0, (my - slope * mx) * scale), slope * scale, "fit", len(points),
                 round(max(0.0, min(1.0, confidence)), 3), band=(Z * sigma, w, mx, sxx), cap=cap, left=left)


def _raised(points: List[Point], spread: float, high: float) -> Tuple[float, float]:
    """(fixed_bytes, per_sample_bytes) of _line(points, ...), all that the line through every
    batch size is read for where the ones near the largest draw the curve (its left)."""
    _, _, _, mx, my, _, _, slope = _fitted(points)
    slope = max(0.0, slope)
    scale = 1 + _headroom(points, mx, my, slope, spread, high)
    return max(0.0, (my - slope * mx) * scale), slope * scale


def _fitted(points: List[Point]) -> Tuple[List[float], List[int], int, float, float, List[float], float, float]:
    """The least-squares line through the batch sizes' medians, each weighted by its reports:
    (medians, weights, their sum, mean batch, mean median, each batch less the mean, Sxx, slope).
    The sums run over map()s, not generators (a fit's time went to them), term by term as
    k * (x - mx) ** 2 and the rest are written: the same floats in the same order."""
    xs = [float(p.batch) for p in points]
    ys = list(map(_middle, points))
    ws = list(map(len, map(_peaks, points)))  # a median of k reports is k times as sure (about)
    w = sum(ws)
    mx: float = sum(map(operator.mul, ws, xs)) / w
    my: float = sum(map(operator.mul, ws, ys)) / w
    dx = [x - mx for x in xs]
    sxx: float = sum(map(operator.mul, ws, map(pow, dx, _TWOS)))  # k * (x - mx) ** 2
    # k * (x - mx) * (y - my)
    slope: float = sum(map(operator.mul, map(operator.mul, ws, dx), [y - my for y in ys])) / sxx
    return ys, ws, w, mx, my, dx, sxx, slope


def _headroom(points: List[Point], mx: float, my: float, slope: float, spread: float, high: float) -> float:
    """Headroom of one step over the middle line (my + slope (x - mx)): the ``high`` quantile of
    the reports' excess (the 90th, ignoring rare spikes, where an overshoot can be caught; the
    highest where it kills), and never less than the spread assumed (assumed_spread). Measured
    where planning works, at the batch sizes within LOCAL of the largest, as a share of the peak
    there: real curves bend, and a CNN's line from batch 32 to 1279 stood 200 MiB below its
    report at 358 (the step from 32 to 178 cost more per sample than the rest); taken as
    headroom for every batch, that excess left a fifth of its 2 GiB group unused."""
    upper = _near(points)
    return max(excess_at(upper, [my + slope * (p.batch - mx) for p in upper], high), spread)
