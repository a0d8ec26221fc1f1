"""Rollout health: did the student's rollouts stop ending, or leave their start in length? A detector on OPD's log.

On-policy distillation can quietly teach the student never to stop (reverse KL's pull on the end token vanishes
as the student's own EOS probability does), and the averaged loss curve does not show it: a never-ending rollout
adds cheap, low-divergence tail tokens, so the logged divergence may even fall. This module judges the step
log's rollout columns against the rollouts of the run's own start, and says when and how they left it.

What it reads, per on-policy step (steps that trained on the teacher's text, GKD's λ < 1, are skipped): the
number of rollouts (``task/rollouts``; for a log older than that column, the stage's global batch), the share
that ended with an EOS (``task/eos_rate``), the share cut at ``max_new_tokens`` (``task/truncation_rate``), and
their mean length and mean squared length (``task/response_length``, ``task/response_length_sq``).

The test, at each on-policy step t after the baseline: the **baseline** is the run's first ``baseline_steps``
on-policy steps (the start's own rollouts: at step 0 no update has happened yet), the **window** the last
``window`` on-policy steps up to t (fewer right after the baseline). Five one-sided tests of window against
baseline:

- ``stopped_ending``: fewer rollouts ended in the window (Fisher's exact test on the 2 × 2 counts);
- ``ending_early``: more ended (the same test, the other side);
- ``truncated_more``: more were cut at ``max_new_tokens`` (Fisher);
- ``longer`` / ``shorter``: the mean length rose / fell (Welch's statistic on the two groups' rollouts, read
  against Student's t with the Welch–Satterthwaite degrees of freedom; needs ``response_length_sq``). A baseline
  is one step of a few rollouts, so the normal reading would be far too sure: 8 rollouts of mean 17.4 tokens
  against a window of 8 cut at 48 gave p = 1.8e-11 read against the normal and 1.5e-4 against t with 7 degrees
  of freedom (a one-step stall that a GKD-style run at λ = 0.25 recovered from).

Fisher's test conditions on the total count, so it needs no estimate of the start's rate: when every rollout
ends with the same probability, whatever it is, a test's p-value is below α with probability at most α. The
baseline is short on purpose, since the collapse this guards against took three steps; its size bounds how small
a p-value can get (all k baseline ends and none in the window gives about (n_B / (n_B + n_W))^k), so the window
is several steps. An alarm is the first step at which any test's p-value is below ``alpha``; the step log of a
healthy run is not exchangeable (a student may legitimately learn to end more often), so the false-alarm rate is
measured on healthy runs rather than taken from α (``studies/rollout_health.py``; its figures in the report).

Plain Python (``math``): the report, ``ars-opd summary``, ``ars-opd check`` and the OPD stage itself (a warning
line the step it fires) all call ``detect``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

from ars_opd.config import ReportConfig
from ars_opd.student_t import student_t_sf

KINDS = ("stopped_ending", "ending_early", "truncated_more", "longer", "shorter")
WORDS = {
    "stopped_ending": "the rollouts stopped ending",
    "ending_early": "the rollouts end more often than at the start",
    "truncated_more": "more rollouts are cut at max_new_tokens",
    "longer": "the rollouts grew longer",
    "shorter": "the rollouts grew shorter",
}


@dataclass(frozen=True)
class StepRollouts:
    """One on-policy step's rollouts: how many, how many ended with an EOS, how many were cut, and the sums of their
    lengths and squared lengths (None when the log has no squared column)."""

    step: int
    n: int
    ended: int
    cut: int
    length_sum: float
    length_sq_sum: float | None = None


@dataclass(frozen=True)
class HealthConfig:
    """The detector's settings (the report section's ``rollout_*`` keys, whose defaults these are)."""

    @classmethod
    def of(cls, report) -> "HealthConfig":
        """From a ``ReportConfig`` (or None: the defaults)."""
        if report is None:
            return cls()
        return cls(report.rollout_baseline_steps, report.rollout_window, report.rollout_alpha)

    baseline_steps: int = ReportConfig.rollout_baseline_steps
    window: int = ReportConfig.rollout_window
    alpha: float = ReportConfig.rollout_alpha


@dataclass(frozen=True)
class Alarm:
    """The first alarm of a run: its step, what moved, the p-value, and the two groups' figures."""

    step: int
    kind: str
    p: float
    baseline: tuple[int, int]  # (first, last) step of the baseline
    window: tuple[int, int]  # (first, last) step of the window
    baseline_value: float  # the rate (ended or cut share) or the mean length of the baseline's rollouts
    window_value: float
    alpha: float

    @property
    def rate(self) -> bool:
        return self.kind in ("stopped_ending", "ending_early", "truncated_more")

    def line(self, stage: str = "opd") -> str:
        """The run's verdict in one line."""
        what = "cut share" if self.kind == "truncated_more" else ("EOS rate" if self.rate else "mean length")
        fmt = (lambda v: f"{v:.0%}") if self.rate else (lambda v: f"{v:.1f} tokens")
        span = lambda a, b: f"step {a}" if a == b else f"steps {a}–{b}"  # noqa: E731
        return (
            f"{stage}: {WORDS[self.kind]} at step {self.step}: {what} {fmt(self.baseline_value)} at the start "
            f"({span(*self.baseline)}) against {fmt(self.window_value)} over {span(*self.window)} "
            f"(p = {self.p:.1e} < {self.alpha:g})"
        )


def _log_choose(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def hypergeometric_tail(k_window: int, n_window: int, total: int, n_all: int, upper: bool) -> float:
    """Fisher's one-sided p-value: with ``total`` successes among ``n_all`` trials, of which ``n_window`` fall in
    the window, P(X <= k_window) (``upper`` False) or P(X >= k_window) (True) for X the window's successes."""
    lo, hi = max(0, n_window - (n_all - total)), min(n_window, total)
    ks = range(lo, k_window + 1) if not upper else range(k_window, hi + 1)
    log_den = _log_choose(n_all, n_window)
    terms = [_log_choose(total, k) + _log_choose(n_all - total, n_window - k) - log_den for k in ks]
    if not terms:
        return 0.0
    m = max(terms)
    return min(1.0, math.exp(m) * sum(math.exp(t - m) for t in terms))


def _pooled(steps: list[StepRollouts]) -> tuple[int, int, int, float, float | None]:
    n = sum(s.n for s in steps)
    sq = None if any(s.length_sq_sum is None for s in steps) else sum(s.length_sq_sum for s in steps)
    return n, sum(s.ended for s in steps), sum(s.cut for s in steps), sum(s.length_sum for s in steps), sq


def step_tests(baseline: list[StepRollouts], window: list[StepRollouts]) -> dict[str, tuple[float, float, float]]:
    """Each test's (p-value, baseline figure, window figure) for ``window`` against ``baseline``."""
    nb, eb, cb, lb, qb = _pooled(baseline)
    nw, ew, cw, lw, qw = _pooled(window)
    out = {
        "stopped_ending": (hypergeometric_tail(ew, nw, eb + ew, nb + nw, upper=False), eb / nb, ew / nw),
        "ending_early": (hypergeometric_tail(ew, nw, eb + ew, nb + nw, upper=True), eb / nb, ew / nw),
        "truncated_more": (hypergeometric_tail(cw, nw, cb + cw, nb + nw, upper=True), cb / nb, cw / nw),
    }
    if qb is not None and qw is not None and nb > 1 and nw > 1:
        mb, mw = lb / nb, lw / nw
        vb = max(qb - nb * mb * mb, 0.0) / (nb - 1)
        vw = max(qw - nw * mw * mw, 0.0) / (nw - 1)
        sb, sw = vb / nb, vw / nw
        se = math.sqrt(sb + sw)
        if not (math.isfinite(mb) and math.isfinite(mw) and math.isfinite(se)):
            return out  # a log whose lengths are not numbers: nothing to test them on
        if se > 0:
            z = (mw - mb) / se
            # Welch–Satterthwaite, written as a ratio of shares so it cannot overflow: between min(nb, nw) − 1
            # and nb + nw − 2
            fb, fw = sb / (sb + sw), sw / (sb + sw)
            df = 1.0 / (fb * fb / (nb - 1) + fw * fw / (nw - 1))
            out["longer"] = (student_t_sf(z, df), mb, mw)
            out["shorter"] = (student_t_sf(-z, df), mb, mw)
        elif mw != mb:  # no spread in either group, yet the means differ: as sure as the counts allow
            out["longer" if mw > mb else "shorter"] = (0.0, mb, mw)
    return out


class HealthMonitor:
    """The detector fed one step at a time (the OPD stage's live check; ``detect`` feeds a whole log): ``add``
    returns the run's first alarm on the step it fires, and None otherwise (also after it fired)."""

    def __init__(self, cfg: HealthConfig = HealthConfig()):
        self.cfg = cfg
        self.steps: list[StepRollouts] = []
        self.alarm: Alarm | None = None
        self.smallest: dict[str, float] = {}  # each test's smallest p-value so far (how near an alarm came)

    def add(self, s: StepRollouts) -> Alarm | None:
        if s.n <= 0:
            return None
        self.steps.append(s)
        b = self.cfg.baseline_steps
        if len(self.steps) <= b:
            return None
        base, win = self.steps[:b], self.steps[b:][-self.cfg.window :]
        first = None
        for kind, (p, vb, vw) in step_tests(base, win).items():
            self.smallest[kind] = min(p, self.smallest.get(kind, 1.0))
            if self.alarm is None and p < self.cfg.alpha and (first is None or p < first.p):
                first = Alarm(
                    s.step, kind, p, (base[0].step, base[-1].step), (win[0].step, win[-1].step), vb, vw, self.cfg.alpha
                )
        if first is not None:
            self.alarm = first
            return first
        return None


PREFIX = "task/"  # the all-rollout columns; with several teachers ``task/<teacher>/`` holds each one's rollouts


def rollouts_of(rows: Iterable[Mapping], batch: int | None = None, prefix: str = PREFIX) -> list[StepRollouts]:
    """The on-policy steps' rollouts of a step log (``steps.jsonl`` rows, or a DataFrame's records): rows without
    the rollout columns, or that trained on the teacher's text, are left out. ``batch``: the rollouts per step
    where the log predates its ``task/rollouts`` column (the stage's global batch size). ``prefix``: whose rollouts
    (``task/<teacher>/``: one teacher's of several, ``teacher_columns``); a step with none of them is left out."""
    out = []
    for r in rows:
        rate = r.get(f"{prefix}eos_rate")
        if rate is None or not math.isfinite(float(rate)) or float(r.get("task/on_policy", 1.0) or 0.0) < 1.0:
            continue
        n = r.get(f"{prefix}rollouts")
        n = int(round(float(n))) if n is not None and math.isfinite(float(n)) else batch
        if not n:
            continue
        sq = r.get(f"{prefix}response_length_sq")
        out.append(
            StepRollouts(
                int(r["step"]),
                n,
                int(round(float(rate) * n)),
                int(round(float(r.get(f"{prefix}truncation_rate", 0.0)) * n)),
                float(r.get(f"{prefix}response_length", 0.0)) * n,
                None if sq is None or not math.isfinite(float(sq)) else float(sq) * n,
            )
        )
    return out


def detect(
    rows: Iterable[Mapping], cfg: HealthConfig = HealthConfig(), batch: int | None = None, prefix: str = PREFIX
) -> HealthMonitor:
    """The detector run over a whole step log; its ``alarm`` is the first alarm (None: the rollouts stayed at their
    start, as far as the tests can tell), ``smallest`` each test's smallest p-value. ``prefix``: whose rollouts
    (``rollouts_of``)."""
    monitor = HealthMonitor(cfg)
    for s in rollouts_of(rows, batch, prefix):
        monitor.add(s)
    return monitor


def teacher_prefixes(rows: Iterable[Mapping]) -> dict[str, str]:
    """{teacher: its columns' prefix} of a log of OPD with several teachers (``task/<teacher>/eos_rate`` present);
    {} for one teacher."""
    names: dict[str, str] = {}
    for r in rows:
        for key in r:
            if key.startswith(PREFIX) and key.endswith("/eos_rate") and key.count("/") == 2:
                names.setdefault(key.split("/")[1], f"{PREFIX}{key.split('/')[1]}/")
        break  # every row has the same columns
    return names
