"""The report path's shortcuts give what the plain computation gives, bit for bit (issue 12's
capacity work: a decision must not change because it got cheaper).

Each shortcut is checked against the plain way over generated inputs: the search for the
largest batch started from a guess against the bisection from 1; a batch size's memoised
Point and the top-report excess against statistics and the full sort; the fit's sums over
map()s against the generator sums they replaced (written out here as they were); the fit's one
pass over the reports against the five it replaced; evolve against dataclasses.replace; the
report a full history drops against the first report of a batch size with the most, in a
session's history and in the state kept for the next run (trimmed at once against point by
point); and the latency bucket found by bisection against the scan of the bounds.
"""
import collections
import dataclasses
import itertools
import math
import statistics

from hypothesis import given, settings
from hypothesis import strategies as st

from memd.core import LATENCY_BUCKETS, Histogram
from memd.policy import fit as fitting
from memd.policy.budget import Pool
from memd.policy.controller import ControlState
from memd.policy.fit import LARGEST, Curve, Observation, excess_at, excess_sorted, fit, largest, point
from memd.policy.frozen import evolve
from memd.sessions import HISTORY, SessionRecord
from memd.state import MAX_POINTS, StateStore, trimmed

MiB, GiB = 2 ** 20, 2 ** 30


@st.composite
def histories(draw):
    """A job's reports as a session keeps them: a few batch sizes, peaks on a line with noise
    and now and then a spike, the first a warm-up, some settling, a base sometimes."""
    fixed = draw(st.integers(0, 40 * GiB))
    per_sample = draw(st.integers(1, 2 * GiB))
    sizes = draw(st.lists(st.integers(1, 9000), min_size=1, max_size=12))
    noise = draw(st.sampled_from([0.0, 0.001, 0.02, 0.3]))
    reports = []
    for i, batch in enumerate(draw(st.lists(st.sampled_from(sizes), min_size=1, max_size=64))):
        wobble = draw(st.floats(-1.0, 1.0))
        spike = draw(st.sampled_from([0, 0, 0, 0, 3 * GiB]))
        peak = max(1, int((fixed + per_sample * batch) * (1 + noise * wobble)) + spike)
        base = draw(st.one_of(st.none(), st.integers(0, 2 * fixed + 1)))
        reports.append(Observation(batch, peak, base, warmup=i == 0, settling=draw(st.booleans())))
    return reports


@settings(max_examples=300, deadline=None)
@given(histories(), st.booleans(), st.sampled_from([0.02, 0.05]), st.floats(0.0, 3.0),
       st.sampled_from([1, 8, 100, 2000]))
def test_the_largest_batch_searched_from_a_guess_is_the_bisections(reports, kills, noise, share, batch):
    curve = fit(reports, None, noise, kills)
    if curve is None:
        return
    for budget in (share * curve.peak(batch), curve.peak(batch), 0.0, 1e30, float("nan")):
        def fits(b):
            return curve.line(b) <= budget and curve.floor(b) <= budget

        plain = largest(fits)  # from 1, no guess: 21 calls
        seen = [s for s, top in curve.observed
                if top * (1 + curve.noise) <= budget and s > plain and curve.floor(s) <= budget]
        assert curve.max_batch(budget) == max(seen + [plain])


@settings(max_examples=300, deadline=None)
@given(st.integers(0, LARGEST + 1), st.integers(-5, LARGEST + 5))
def test_a_guess_never_moves_the_edge(edge, guess):
    def ok(b):
        return b <= edge

    assert largest(ok, near=guess) == largest(ok) == min(edge, LARGEST)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 10 ** 6), st.lists(st.integers(1, 2 ** 62), min_size=1, max_size=64))
def test_a_memoised_point_is_statistics_own(batch, peaks):
    peaks = tuple(sorted(peaks))
    kept = point(batch, peaks)
    assert kept == point.__wrapped__(batch, peaks)
    mean = statistics.fmean(peaks)
    assert kept.middle == float(statistics.median(peaks)) and kept.mean == mean
    assert kept.scatter == tuple((peak - mean) ** 2 for peak in peaks)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(1, 2 ** 63 - 1), min_size=1, max_size=20),
                          st.floats(-1e12, 1e12, allow_nan=False).filter(lambda m: m != 0)), min_size=1, max_size=8),
       st.sampled_from([0.9, 1.0]))
def test_the_excess_from_top_reports_is_the_sorted_one(batches, high):
    points = [point(i + 1, tuple(sorted(peaks))) for i, (peaks, _) in enumerate(batches)]
    middles = [middle for _, middle in batches]
    assert repr(excess_at(points, middles, high)) == repr(excess_sorted(points, middles, high))


def line_as_it_was(points, base, spread, high):
    """fit._line with its sums written as generators over every report, as before map()s."""
    xs = [float(p.batch) for p in points]
    ys = [float(statistics.median(p.peaks)) for p in points]
    ws = [len(p.peaks) for p in points]
    n, w = len(points), sum(ws)
    mx, my = sum(k * x for k, x in zip(ws, xs)) / w, sum(k * y for k, y in zip(ws, ys)) / w
    sxx = sum(k * (x - mx) ** 2 for k, x in zip(ws, xs))
    slope = sum(k * (x - mx) * (y - my) for k, x, y in zip(ws, xs, ys)) / sxx
    residual2 = sum(k * (y - (my + slope * (x - mx))) ** 2 for k, x, y in zip(ws, xs, ys))
    means = [statistics.fmean(p.peaks) for p in points]
    residual2 += sum((peak - mean) ** 2 for p, mean in zip(points, means) for peak in p.peaks)
    sigma = max(math.sqrt((fitting.PRIOR_POINTS * (fitting.NOISE * my) ** 2 + residual2)
                          / (fitting.PRIOR_POINTS + w - 2)), fitting.NOISE * my / 10)
    se = sigma / math.sqrt(sxx)
    slope = max(0.0, slope)
    confidence = slope / (slope + fitting.Z * se) if slope + fitting.Z * se > 0 else 1.0
    upper = [p for p in points if p.batch * fitting.LOCAL >= points[-1].batch]
    excess = sorted(peak / at - 1 for p in upper for at in (my + slope * (p.batch - mx),) for peak in p.peaks)
    headroom = max(max(0.0, excess[min(len(excess) - 1, int(high * len(excess)))]), spread)
    cap = None
    if base is not None:
        bound = max(0.0, max((p.top - base) / p.batch for p in points))
        cap = (max(p.top - bound * p.batch for p in points), bound)
    scale = 1 + headroom
    return Curve(max(0.0, (my - slope * mx) * scale), slope * scale, "fit", n,
                 round(max(0.0, min(1.0, confidence)), 3), band=(fitting.Z * sigma, w, mx, sxx), cap=cap)


@settings(max_examples=300, deadline=None)
@given(histories(), st.booleans(), st.one_of(st.none(), st.floats(0, 1e10)), st.sampled_from([0.0, 0.02, 0.2]))
def test_the_line_through_maps_is_the_line_through_generators(reports, kills, base, spread):
    points = fitting.aggregate(reports, forgive_spikes=not kills)
    if len(points) < 2:
        return
    high = 1.0 if kills else fitting.HIGH
    whole = line_as_it_was(points, base, spread, high)
    assert repr(fitting._line(points, base, spread, high)) == repr(whole)
    # where the batch sizes near the largest draw the curve, all read of this line is its two numbers
    assert repr(fitting._raised(points, spread, high)) == repr((whole.fixed_bytes, whole.per_sample_bytes))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2 ** 40), st.one_of(st.none(), st.integers(0, 2 ** 40)), st.integers(-5, 5))
def test_evolve_is_replace(reserved, share, stable):
    pool = Pool("host", "cpu", 64 * GiB, 20 * GiB, None, GiB)
    state = ControlState(batch=8, ceiling=16, stable=2)
    curve = Curve(1e9, 8e6, "fit", 3, 0.9, observed=((8, 1.1e9),))
    for record, changes in ((pool, dict(reserved_bytes=reserved, share_bytes=share)), (state, dict(stable=stable)),
                            (curve, dict(noise=0.05, kills=True, left=(8, 1.0, 2.0)))):
        cheap, plain = evolve(record, **changes), dataclasses.replace(record, **changes)
        assert cheap == plain and repr(cheap) == repr(plain) and hash(cheap) == hash(plain)
        assert type(cheap) is type(plain) and record == evolve(record)
    try:
        evolve(state, stabel=1)
    except TypeError as exc:
        assert "stabel" in str(exc)
    else:
        raise AssertionError("a misspelt field was taken")


def session():
    return SessionRecord(token="t", sid=1, job="j", pid=1, host="h", local=True, start_time=None,
                         limits=None, created=0.0, last_seen=0.0)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 3, 8, 16, 32]), min_size=HISTORY, max_size=4 * HISTORY))
def test_a_full_history_drops_the_first_report_of_a_batch_size_with_the_most(batches):
    """Ties between batch sizes included; the batch sizes it scans (observed_batches) stay the
    observations' own."""
    kept = session()
    plain = []
    for i, batch in enumerate(batches):
        if len(plain) >= HISTORY:  # the rule as sessions.observe first wrote it
            counts = {b: sum(1 for o in plain if o.batch == b) for b in {o.batch for o in plain}}
            most = max(counts.values())
            del plain[next(k for k, o in enumerate(plain) if counts[o.batch] == most)]
        observation = Observation(batch, i + 1)
        plain.append(observation)
        kept.observe(observation)
        assert kept.observations == plain
        assert kept.observed_batches == [o.batch for o in plain]
        assert kept.observed_at == [o.peak_bytes - 1 for o in plain]


def plain_trim(points, keep):
    """The loop state.trimmed replaced: count every point again for each one dropped."""
    points = list(points)
    while len(points) > keep:
        counts = collections.Counter(b for b, _ in points)
        most = max(counts.values())
        del points[next(i for i, (b, _) in enumerate(points) if counts[b] == most)]
    return points


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 9)), min_size=1, max_size=3 * HISTORY), st.data())
def test_the_trim_at_once_is_the_trim_point_by_point(points, data):
    keep = data.draw(st.integers(1, len(points) + 2))
    assert trimmed([list(p) for p in points], keep) == plain_trim([list(p) for p in points], keep)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 2, 3, 8, 16, 32]), st.integers(0, 3)), max_size=3 * MAX_POINTS))
def test_the_state_keeps_the_points_the_plain_trim_keeps(tmp_path_factory, reports):
    """StateStore.remember trims a history to MAX_POINTS as the loop it replaced did, zero
    peaks left out first."""
    plain = plain_trim([[b, p] for b, p in reports if p > 0], MAX_POINTS)
    store = StateStore(str(tmp_path_factory.mktemp("state")))
    store.remember("j", "cpu:7", [Observation(b, p) for b, p in reports], 3)
    assert [[o.batch, o.peak_bytes] for o in store.recall("j", "cpu:7").observations] == plain


def fit_as_it_was(observations, prior=None, noise=fitting.NOISE, kills=False):
    """fit before its one pass over the reports (fitting.credible): warm-ups out, settling ones
    out where a settled report shares their batch size, then aggregate and _base, each its own pass
    (the spread the job shows within a stay at a batch size is read off all its reports, as fit does)."""
    stays = [[o.peak_bytes for o in run if not (o.warmup or o.settling) and o.peak_bytes > 0 and o.batch >= 1]
             for _, run in itertools.groupby(observations, key=lambda o: o.batch)]
    shown = fitting.shown_spread(stays, list if kills else fitting._without_isolated_spike)
    observations = [o for o in observations if not o.warmup]
    if any(o.settling for o in observations):
        settled = {o.batch for o in observations if not o.settling}
        top = {b: max((o.peak_bytes for o in observations if o.batch == b and not o.settling), default=0)
               for b in settled}
        observations = [o for o in observations if not (o.settling and o.batch in settled) or (
            kills and o.settling and o.batch in settled and o.peak_bytes > top[o.batch] and top[o.batch] > 0)]
    points = fitting.aggregate(observations, forgive_spikes=not kills)
    if not points:
        if prior is None:
            return None
        return Curve(float(prior.fixed_bytes), float(prior.per_sample_bytes), "prior", 0, 0.0, kills=kills)
    base = fitting._base(observations, points)
    noise = fitting.assumed_spread(shown, noise)
    if len(points) == 1:
        curve = fitting._one_point(points[0], base, prior)
    else:
        curve = fitting._near_the_largest(points if kills else fitting._without_spiked_batch(points, noise), base,
                                          noise, 1.0 if kills else fitting.HIGH)
    observed = tuple((p.batch, p.top) for p in points)
    beyond = observed[-2] + observed[-1] if kills and len(observed) > 1 else None
    return evolve(curve, observed=observed, noise=noise, kills=kills, beyond=beyond)


@st.composite
def odd_histories(draw):
    """histories() with reports no client sends but a hand-edited state file or a test might: a
    zero peak, a batch of 0, a settling report alone at its batch size."""
    reports = draw(histories())
    for _ in range(draw(st.integers(0, 4))):
        at = draw(st.integers(0, len(reports)))
        reports.insert(at, Observation(draw(st.sampled_from([0, 1, reports[0].batch])), draw(st.sampled_from([0, 5])),
                                       draw(st.one_of(st.none(), st.integers(0, 9))), settling=draw(st.booleans())))
    return reports


@settings(max_examples=400, deadline=None)
@given(st.one_of(histories(), odd_histories()), st.booleans(), st.sampled_from([0.02, 0.05]),
       st.one_of(st.none(), st.builds(fitting.Prior, st.integers(0, 2 ** 40), st.integers(0, 2 ** 30))))
def test_the_fit_in_one_pass_is_the_fit_in_five(reports, kills, noise, prior):
    assert repr(fit(reports, prior, noise, kills)) == repr(fit_as_it_was(reports, prior, noise, kills))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(LATENCY_BUCKETS), st.floats(0.0, 1.0)), max_size=50))
def test_the_latency_histogram_counts_what_a_scan_of_its_bounds_counts(values):
    histogram = Histogram(LATENCY_BUCKETS)
    plain = [0] * len(LATENCY_BUCKETS)
    for value in values:
        histogram.observe(value)
        for i, bound in enumerate(LATENCY_BUCKETS):  # the loop observe() was
            if value <= bound:
                plain[i] += 1
                break
    assert histogram.counts == plain and histogram.count == len(values)
