"""The consistency detector: per-rank sequential tests with a stated false-alarm rate.

Input: a training stage's per-step log (``steps.jsonl``): each worker's loss L_k, gradient norm ‖g_k‖ and
cos(g_k, ḡ), taken before the all-reduce (``ars_opd.training.consistency``). Output: alarms, each naming a
rank, a statistic, the step it fired, the step the change began, and whether the averaged loss curve
showed anything at the time ("visible") or not ("silent").

Method (every function below is pure; the report and ``studies/detection.py`` run the same code):

1. Per-rank residuals remove what all workers share (the training trend) by comparing each worker with
   the median worker of the same step: loss log(L_k / median_j L_j), gradient norm
   log(‖g_k‖ / median_j ‖g_j‖), direction cos(g_k, ḡ) − median_j cos(g_j, ḡ).
2. Each residual is standardised against a null learned from the run itself: its normal score (the
   standard-normal quantile of its rank) within the same statistic over the trailing ``window`` steps
   (ending ``lag`` steps back), pooled over all ranks, so one faulty rank is a minority of the data its
   own yardstick comes from. Rank-based scores are N(0, 1) under the null whatever the shape of the
   mini-batch noise, and bounded: one outlying step adds at most about 2.8 − k to a test.
3. A two-sided CUSUM per rank and statistic, S⁺ = max(0, S⁺ + z − k), S⁻ = max(0, S⁻ − z − k), crosses
   when S reaches h and restarts. A sustained shift of δ standard deviations is caught in about h / (δ − k)
   steps; the estimated onset is the step after S last stood at 0. Crossings of one rank at most
   ``MERGE_STEPS`` apart (any statistic) form one alarm: one event often moves several statistics of a rank,
   and a sustained change crosses again after each restart. A crossing names the rank whose scores moved
   most since the onset (``attribute``): an outlying rank shifts the others' references the other way.
4. h is set from a design false-alarm rate: with 3 statistics × K ranks × 2 sides monitored (with K = 2
   one rank's residual is the other's negative, so one rank is tested and an alarm names no rank), each
   test's in-control average run length must be ``1000 · tests / rate`` steps for ``rate`` alarms per 1,000
   steps in all; Siegmund's approximation ARL(h) = (e^{2kb} − 2kb − 1)/(2k²), b = h + 1.166, for
   independent N(0, 1) scores, is solved for h (``cusum_threshold``). Real training runs alarm more often
   than independent scores would (on the benchmark's healthy runs, about three times the design rate:
   brief runs of harder batches on one rank are real), so the default design rate is a quarter of the
   1-per-1,000 target, and the rate measured by ``studies/detection.py`` is what the report quotes.
5. An alarm is "visible" when the same test on the global loss's own standardised residual (against its
   trailing median) alarms between the alarm's estimated onset and the alarm; else "silent".

Settings: the report params (``ReportConfig``). Steps before ``warmup`` are not judged (the null needs data).
Replica drift (bit-exact fingerprints, ``ars_opd.training.drift``) needs no statistics: any mismatch is an
alarm naming the ranks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np

from ars_opd.config import ReportConfig
from ars_opd.evaluation.solve import solve_increasing

STATISTICS = ("loss", "grad_norm", "direction")
SIEGMUND_SHIFT = 1.166  # Siegmund's correction of the CUSUM boundary for the overshoot
_normal_quantile = np.vectorize(NormalDist().inv_cdf, otypes=[float])


MERGE_STEPS = 10  # test crossings on one rank this close together are one alarm


@dataclass(frozen=True)
class Alarm:
    """One alarm: every test crossing on one rank with gaps of at most ``MERGE_STEPS`` steps."""

    step: int  # the first crossing
    rank: int | None  # None: two workers, where either may be the faulty one
    statistic: str  # the statistics that crossed, "+"-joined: loss, grad_norm, direction; or drift
    direction: str  # up | down per statistic, "+"-joined; mismatch for drift
    value: float  # the largest CUSUM value at a crossing (0 for drift)
    onset: int  # estimated first step of the change
    visible: bool  # the averaged loss curve showed it too
    last_step: int = -1  # the last crossing
    crossings: int = 1

    def to_dict(self) -> dict:
        return asdict(self)


def merge_crossings(crossings: list[tuple[int, int | None, str, str, float, int, bool]]) -> list[Alarm]:
    """Group (step, rank, statistic, direction, value, onset, visible) crossings into alarms: per rank,
    crossings at most ``MERGE_STEPS`` apart belong to one alarm (a sustained change crosses again and again,
    and one event often moves several statistics of the same rank)."""
    alarms: list[Alarm] = []
    open_: dict = {}
    for step, rank, stat, side, value, onset, visible in sorted(crossings, key=lambda c: (c[0], c[2])):
        cur = open_.get(rank)
        if cur is not None and step - cur["last"] <= MERGE_STEPS:
            if (stat, side) not in cur["stats"]:
                cur["stats"].append((stat, side))
            cur.update(
                last=step,
                value=max(cur["value"], value),
                onset=min(cur["onset"], onset),
                visible=cur["visible"] or visible,
                n=cur["n"] + 1,
            )
            continue
        if cur is not None:
            alarms.append(_alarm(rank, cur))
        open_[rank] = {
            "first": step,
            "last": step,
            "stats": [(stat, side)],
            "value": value,
            "onset": onset,
            "visible": visible,
            "n": 1,
        }
    alarms += [_alarm(rank, cur) for rank, cur in open_.items()]
    return sorted(alarms, key=lambda a: (a.step, -1 if a.rank is None else a.rank))


def _alarm(rank, cur) -> Alarm:
    return Alarm(
        cur["first"],
        rank,
        "+".join(s for s, _ in cur["stats"]),
        "+".join(d for _, d in cur["stats"]),
        round(float(cur["value"]), 3),
        cur["onset"],
        cur["visible"],
        cur["last"],
        cur["n"],
    )


def siegmund_arl(h: float, k: float) -> float:
    """In-control average run length of a one-sided CUSUM on N(0, 1) data (Siegmund's approximation)."""
    b = h + SIEGMUND_SHIFT
    x = 2 * k * b
    return (math.exp(x) - x - 1) / (2 * k * k)


def cusum_threshold(target_arl: float, k: float) -> float:
    """The h whose ``siegmund_arl(h, k)`` equals ``target_arl`` (bisection; ARL grows with h)."""
    if target_arl <= 1 or k <= 0:
        raise ValueError(f"need target_arl > 1 and k > 0, got {target_arl}, {k}")
    return solve_increasing(lambda h: siegmund_arl(h, k), target_arl)


def design_rate(settings: ReportConfig, workers: int) -> float:
    """The design false-alarm rate per 1,000 steps for a run of ``workers`` (calibrated per K)."""
    return settings.two_worker_false_alarms_per_1000 if workers == 2 else settings.false_alarms_per_1000


def threshold_for(settings: ReportConfig, workers: int) -> float:
    """h for the design rate over 3 statistics × the tested ranks × 2 sides of a run of ``workers``."""
    tests = len(STATISTICS) * monitored_ranks(workers) * 2
    return cusum_threshold(1000.0 * tests / design_rate(settings, workers), settings.k)


def rank_residuals(worker_loss: np.ndarray, worker_norm: np.ndarray, worker_cos: np.ndarray) -> dict[str, np.ndarray]:
    """Each (T, K) statistic relative to the median worker of the same step.

    The median of all K workers (the rank included) moves least when one rank departs: with K = 4 it is the
    mean of the middle two, which an outlier leaves to the healthy ranks, while a median of the three others
    would be pulled towards it. Under the null the ranks are exchangeable, so every rank's residual has
    the same distribution and one pooled yardstick serves all of them (``standardise`` scores ranks, so the
    residual's shape does not matter).
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        loss = np.log(worker_loss) - np.log(np.median(worker_loss, axis=1, keepdims=True))
        norm = np.log(worker_norm) - np.log(np.median(worker_norm, axis=1, keepdims=True))
    direction = worker_cos - np.median(worker_cos, axis=1, keepdims=True)
    return {"loss": loss, "grad_norm": norm, "direction": direction}


def standardise(x: np.ndarray, settings: ReportConfig) -> np.ndarray:
    """(T, K) normal scores against the pooled trailing window; NaN where not judged (warm-up, no data).

    At step t the window is w = x[t − lag − window : t − lag] (every rank). Each value's score is
    z = Φ⁻¹(u), u = (#{w < x} + ½·#{w = x} + ½) / (n + 1): the standard-normal quantile of its rank in the
    window, so z is N(0, 1) under the null whatever the statistic's distribution (mini-batch noise is
    heavy-tailed: a MAD or standard-deviation yardstick let single outliers and fat shoulders through), and
    |z| can exceed ``clip_z`` only as far as the window's size allows (about 2.8 for 400 values: a value
    beyond everything seen counts the same however far beyond). Fewer than 8 finite values: not judged.
    """
    T = x.shape[0]
    z = np.full(x.shape, np.nan)
    for t in range(settings.warmup, T):
        end = t - settings.lag
        w = np.sort(x[max(0, end - settings.window) : max(0, end)].ravel())
        w = w[np.isfinite(w)]
        if len(w) < 8:
            continue
        v = x[t]
        ok = np.isfinite(v)
        below = np.searchsorted(w, v[ok], side="left")
        equal = np.searchsorted(w, v[ok], side="right") - below
        u = (below + 0.5 * equal + 0.5) / (len(w) + 1)
        z[t, ok] = np.clip(_normal_quantile(u), -settings.clip_z, settings.clip_z)
    return z


def cusum(z: np.ndarray, k: float, h: float) -> list[tuple[int, str, float, int]]:
    """Two-sided CUSUM over one series (NaN steps are skipped): (step, "up"|"down", value, onset) per alarm.

    After an alarm the test restarts at 0, so a sustained change keeps alarming every few steps.
    """
    out = []
    up = down = 0.0
    up_start = down_start = None
    for t, v in enumerate(z):
        if not math.isfinite(v):
            continue
        up = max(0.0, up + v - k)
        down = max(0.0, down - v - k)
        up_start = None if up == 0 else (t if up_start is None else up_start)
        down_start = None if down == 0 else (t if down_start is None else down_start)
        if up >= h:
            out.append((t, "up", up, up_start))
            up, up_start = 0.0, None
        if down >= h:
            out.append((t, "down", down, down_start))
            down, down_start = 0.0, None
    return out


def global_loss_alarms(loss: np.ndarray, settings: ReportConfig, h: float) -> list[tuple[int, str, float, int]]:
    """The same test on the averaged loss curve: log(loss_t) against its trailing median, standardised."""
    x = np.log(np.asarray(loss, dtype=float))
    resid = np.full(len(x), np.nan)
    for t in range(1, len(x)):
        prev = x[max(0, t - 20) : t]
        prev = prev[np.isfinite(prev)]
        if len(prev):
            resid[t] = x[t] - np.median(prev)
    z = standardise(resid[:, None], settings)[:, 0]
    return cusum(z, settings.k, h)


def _matrix(rows: list[dict], key: str) -> np.ndarray:
    return np.array([[float("nan") if v is None else v for v in r.get(key) or []] for r in rows], dtype=float)


def monitored_ranks(workers: int) -> int:
    """Ranks with a test of their own: with two workers each residual is the other's negative, so one rank's
    test sees everything (and cannot tell which of the two is wrong)."""
    return 1 if workers == 2 else workers


def standardised_residuals(rows: list[dict], settings: ReportConfig) -> dict[str, np.ndarray]:
    """The (T, K) z-scores each test runs on, by statistic (empty for a log without per-worker columns)."""
    if not rows or "consistency/worker_grad_norm" not in rows[0]:
        return {}
    loss, norm, cos = (
        _matrix(rows, k) for k in ("worker_loss", "consistency/worker_grad_norm", "consistency/worker_cos_to_mean")
    )
    if loss.shape[1] < 2:
        return {}
    return {name: standardise(x, settings) for name, x in rank_residuals(loss, norm, cos).items()}


def attribute(z: np.ndarray, onset: int, t: int) -> int:
    """The rank a crossing points at: the one whose scores moved most (largest |mean z|) from the onset.

    One outlying rank also moves the others' references (it is one of the workers their median is taken
    over), so their scores drift the opposite way, only less; the test of a healthy rank can then cross
    first. Naming the rank with the strongest departure over the change's span undoes that.
    """
    span = z[onset : t + 1]
    means = np.nanmean(span, axis=0) if np.isfinite(span).any() else np.zeros(z.shape[1])
    return int(np.nanargmax(np.abs(means)))


def detect(rows: list[dict], settings: ReportConfig = ReportConfig()) -> list[Alarm]:
    """Every alarm on one stage's per-step log rows (dicts as in ``steps.jsonl``), sorted by step.

    Statistical alarms merge the test crossings of one rank (``merge_crossings``); each replica-drift
    mismatch is an alarm of its own, naming the rank."""
    if not rows:
        return []
    steps = [int(r["step"]) for r in rows]
    crossings = []
    z_by_stat = standardised_residuals(rows, settings)
    if z_by_stat:
        K = next(iter(z_by_stat.values())).shape[1]
        h = threshold_for(settings, K)
        global_alarms = global_loss_alarms(np.array([r["loss"] for r in rows], dtype=float), settings, h)
        for name, z in z_by_stat.items():
            for rank in range(monitored_ranks(K)):
                for t, side, value, onset in cusum(z[:, rank], settings.k, h):
                    visible = any(onset - 1 <= g <= t for g, _, _, _ in global_alarms)
                    named = attribute(z, onset, t) if K > 2 else None
                    side = side if named in (None, rank) else ("down" if side == "up" else "up")
                    crossings.append((steps[t], named, name, side, value, steps[onset], visible))
    alarms = merge_crossings(crossings)
    for t, r in enumerate(rows):
        for rank in r.get("drift_mismatch") or []:
            alarms.append(Alarm(steps[t], rank, "drift", "mismatch", 0.0, steps[t], False, steps[t]))
    return sorted(alarms, key=lambda a: (a.step, -1 if a.rank is None else a.rank, a.statistic))


def poisson_cdf(c: int, mu: float) -> float:
    """P(X <= c) for X ~ Poisson(mu)."""
    term = total = math.exp(-mu)
    for i in range(1, c + 1):
        term *= mu / i
        total += term
    return min(1.0, total)


def rate_interval(count: int, exposure: float, level: float = 0.95, per: float = 1000.0) -> tuple[float, float]:
    """Exact (Garwood) interval for a Poisson rate: ``count`` events in ``exposure`` units, per ``per`` units.

    The bounds are the means mu_L, mu_U with P(X >= count; mu_L) = P(X <= count; mu_U) = (1 - level) / 2
    (mu_L = 0 for no events), each solved by bisection on the Poisson distribution function.
    """
    if exposure <= 0:
        return float("nan"), float("nan")
    tail = (1 - level) / 2
    lower = 0.0 if count == 0 else solve_increasing(lambda mu: 1 - poisson_cdf(count - 1, mu), tail)
    upper = solve_increasing(lambda mu: 1 - poisson_cdf(count, mu), 1 - tail)
    return per * lower / exposure, per * upper / exposure
