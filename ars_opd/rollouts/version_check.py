"""Which version does the engine serve? Rank 0's check after every sync, with what it keeps from sync to sync.

After the engine has loaded version v, rank 0 compares the hashes of the tensors the engine computes with with
those it published (``ars_opd.rollouts.fingerprint``) and the engine's log-probabilities on fixed probe
sequences with its own forward of the weights it published (``ars_opd.rollouts.verify``), and refuses the
engine (``StaleEngineError``, one line naming every finding, before any rollout of v is used) when a tensor
differs or the probe differs by more than the tolerance τ.

**The tolerance is calibrated, not only derived.** The derived worst-case fp32 bound (``probe_bound``) grows
with width × depth and vocabulary × max |logit|: 0.0017–0.0057 on the built-in students but 0.37–0.51 nats on
a real 81M-parameter student, while one AdamW step at lr 1e-6 moves its probe by a few hundredths, so a probe
held only to that bound passes an engine still serving the previous version. At the first sync of a run (the
engine loaded with the trainer's starting weights) the engine scores ``calibration`` distinct seeded probe
sequences; d0, the largest |engine − trainer| over them, is what the two computations of the same weights
differ by here, on these kernels. d0 must be within the derived bound (or the explicit
``opd.engine.probe_tolerance``), else the engine does not serve the published start and is refused. Every
later sync is held to τ = min(bound, max(margin × d0, floor)), ``floor`` = 64 · 2⁻²⁴ · max(1, max |logit|)
(a few dozen roundings of the largest logit), so that a d0 of exactly 0 (the bundled engine runs the trainer's
own kernels) leaves room for the roundings of a later sync's other weights; an explicit
``opd.engine.probe_tolerance`` is τ itself.

Why a tolerance observed at the first sync holds at the later ones: the difference between the engine and
the trainer is rounding, and rounding is set by the kernels (the same processes serve the whole run), the
inputs (the same probe tokens), the shapes (the probe is scored alone, after the drain) and the magnitudes of
weights and activations, which lr-sized steps change by a relative 1e-6 to 1e-4 per step; the margin covers
that the later probe lands elsewhere in the distribution of roundings than the calibration's maximum. Its
limit: it assumes the engine keeps its kernels. An engine restarted with another build or thread count, a
run whose weights drift far (thousands of steps at a high rate), or an engine that batches the probe with
other requests could differ by more than τ and be refused though fresh (a false refusal, never a false pass
of a stale engine: τ is always at most the derived bound); a resumed run calibrates again.

**A verdict when an update is too small to tell apart.** s_v = max |trainer_v − trainer_{v−1}| on the probe:
an engine still on v − 1 would pass when s_v ≤ 2τ. If the fingerprint (``ars_opd.rollouts.fingerprint``)
verified every tensor exactly, the version is proven whatever s_v; otherwise the sync is *indistinguishable*
and ``indistinguishable`` decides: ``refuse`` stops the stage with one line, ``warn`` logs it (the step's
``indistinguishable`` column, counted by ``ars-opd check`` and the report).

**The engine's log-probabilities of what it sampled** (``check_lag0``). Every rollout comes back with the
engine's log q of each sampled token, and the trainer computes its own in the step's forward
(``engine_abs_dlogp``, the mean |Δ| over the step's trained tokens). At lag 0 the engine sampled with the very
weights the probe just verified, so the two differ by rounding alone, and the step's mean must be within τ (a
mean of differences each bounded like the probe's; measured at real scale, 3% of τ on the bundled engine). What
passes the probe and fails here: an engine restarted at the same URL between syncs (serving its base weights),
staleness only in its decode path, a stale prefix cache. ``opd.engine.dlogp_check``: ``refuse`` stops the stage
with one line before the step's update, ``warn`` logs it. Not checked: at lag ≥ 1 (the column then measures the
policy's drift over the lag, not the engine), and where the training forward is not the fp32 function the engine
computes (bf16 autocast or FSDP mixed precision, dropout: ``lag0_unchecked``), where the column is logged only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ars_opd.rollouts.fingerprint import FingerprintResult
from ars_opd.rollouts.verify import U32, StaleEngineError, probe_ids
from ars_opd.seeding import derive_seed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckSettings:
    """How the version check decides (``opd.engine``'s probe_tokens, probe_tolerance, probe_calibration,
    probe_margin, indistinguishable, fingerprint)."""

    tokens: int = 32
    tolerance: float | None = None  # τ itself (an engine outside the fp32 rounding model); None: calibrated
    calibration: int = 4  # probe sequences scored at the first sync
    margin: float = 8.0
    indistinguishable: str = "warn"  # warn | refuse
    fingerprint: bool = True  # ask the engine for the hashes of what it holds (ars_opd.rollouts.fingerprint)


def floor(max_abs_logit: float) -> float:
    """The least tolerance: a few dozen fp32 roundings of the largest logit."""
    return 64 * U32 * max(1.0, max_abs_logit)


def calibrated_tolerance(d0: float, bound: float, margin: float, max_abs_logit: float) -> float:
    """τ = min(bound, max(margin × d0, floor))."""
    return min(bound, max(margin * d0, floor(max_abs_logit)))


class VersionCheck:
    """Rank 0's version check over a run: the probe sequences, the calibrated tolerance and the previous
    version's probe (the module docstring)."""

    def __init__(self, settings: CheckSettings, seed: int, vocab: int):
        self.settings, self.seed, self.vocab = settings, seed, vocab
        self.tolerance: float | None = None  # τ, once calibrated
        self.previous: torch.Tensor | None = None  # the trainer's probe (sequence 0) of the previous version

    def sequences(self) -> list[list[int]]:
        """The probe sequences to score now: ``calibration`` of them at the first sync, then the first alone.
        Sequence 0 is seeded by the stage's seed; the others by seeds derived from it, each distinct."""
        n = self.settings.calibration if self.tolerance is None else 1
        seeds = [self.seed] + [derive_seed(self.seed, f"probe-calibration-{i}") for i in range(1, n)]
        out = [probe_ids(self.vocab, self.settings.tokens, s) for s in seeds]
        assert len({tuple(x) for x in out}) == len(out), "probe sequences collide"
        return out

    def verify(
        self,
        version: int,
        engine: list[list[float]],
        trainer: list[torch.Tensor],
        scale: tuple,
        where: str,
        exact: FingerprintResult | None = None,
    ) -> dict:
        """Check the engine's log-probabilities (one list per sequence of ``sequences()``) against the trainer's,
        and its fingerprint (``exact``; None: none was asked); ``scale``: the derived bound and the largest
        |logit| of the trainer's probe. The sync's row, or ``StaleEngineError`` naming every finding."""
        bound, max_logit = scale
        got = []
        for values, mine in zip(engine, trainer, strict=True):
            row = torch.tensor(values, dtype=torch.float64)
            if row.shape != mine.shape:
                raise StaleEngineError(
                    f"the engine at {where} scored {row.numel()} probe positions, expected {mine.numel()}"
                )
            got.append(row)
        diffs = [(g - t).abs() for g, t in zip(got, trainer)]
        finite = all(bool(torch.isfinite(g).all()) for g in got)
        worst = max(float(d.max()) for d in diffs) if finite else float("inf")
        first = self.tolerance is None
        limit = self.settings.tolerance or (bound if first else self.tolerance)
        if worst > limit or (exact is not None and exact.mismatched):
            raise StaleEngineError(self._refusal(version, (got[0], worst, limit), exact, where, first))
        if first:
            explicit = self.settings.tolerance
            self.tolerance = explicit or calibrated_tolerance(worst, bound, self.settings.margin, max_logit)
        separation = None if self.previous is None else float((trainer[0] - self.previous).abs().max())
        unread = len(exact.unread) if exact is not None else None
        proven = exact is not None and not exact.unread  # every tensor verified exactly: staleness is excluded
        row = {
            "probe_max_abs_diff": worst,
            "probe_mean_abs_diff": float(torch.cat(diffs).mean()),
            "probe_bound": bound,
            "probe_tolerance": self.tolerance,
            "probe_d0": worst if first else None,
            "probe_separation": separation,
            "indistinguishable": None if separation is None else float(separation <= 2 * self.tolerance and not proven),
            "tensors_verified": exact.verified if exact is not None else 0,
            "tensors_probe_only": unread,
            "fingerprint_s": exact.seconds if exact is not None else None,
        }
        self.previous = trainer[0]
        if row["indistinguishable"]:
            self._indistinguishable(row, version, where)
        return row

    def _indistinguishable(self, row: dict, version: int, where: str) -> None:
        """The verdict on an update too small to tell apart: a refusal, or a logged warning."""
        message = (
            f"the update to policy version {version} moved the probe by {row['probe_separation']:.3g}, not more "
            f"than twice the tolerance {row['probe_tolerance']:.3g}, and not every tensor could be verified "
            f"exactly: an engine at {where} still serving version {version - 1} would have passed"
        )
        if self.settings.indistinguishable == "refuse":
            raise StaleEngineError(
                f"{message}. Stopped (opd.engine.indistinguishable: refuse): raise the learning rate, lengthen the "
                "probe (opd.engine.probe_tokens), or set opd.engine.indistinguishable: warn to go on unverified"
            )
        log.warning("%s (opd.engine.indistinguishable: warn)", message)

    def _refusal(self, version: int, probe: tuple, exact: FingerprintResult | None, where: str, first: bool) -> str:
        """One line for every finding: the probe past its limit (``probe``: the engine's sequence 0, the largest
        difference, the limit), the tensors whose hashes differ."""
        got, worst, limit = probe
        what = f"the published start of this run, policy version {version}" if first else f"policy version {version}"
        held = "the derived fp32 bound" if first and not self.settings.tolerance else "the tolerance"
        findings = []
        if worst > limit:
            differ = f"its log-probabilities on the probe differ from the trainer's by up to {worst:.3g}"
            findings.append(f"{differ} ({held} {limit:.3g})")
        if exact is not None and exact.mismatched:
            findings.append(exact.message())
        elif exact is not None:
            findings.append("although every tensor it could show is the published one")
        if worst <= limit:
            findings.append(f"although its probe is within {held} ({worst:.3g} <= {limit:.3g})")
        stale = ""
        if self.previous is not None and float((got - self.previous).abs().max()) <= limit:
            stale = " It matches the previous version: the engine did not take the new weights."
        return (
            f"the rollout engine at {where} does not serve {what}: {'; '.join(findings)}.{stale} No rollout of this "
            "version is used. Check that the engine loads the published weights (vLLM: started with the ars-opd "
            "worker extension, or --weight-transfer-config for transport nccl; see the README's engine rollouts "
            "section)."
        )


def lag0_unchecked(model: torch.nn.Module, precision: str, device: torch.device) -> str | None:
    """Why a lag-0 step's log-probabilities cannot be held to τ (None: they can): the training forward is not the
    fp32, dropout-free function the engine computes."""
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return "the training forward computes in bf16"
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return "the training forward applies dropout"
    config = getattr(model, "config", None)
    rates = {k: v for k, v in vars(config).items() if "dropout" in k or "pdrop" in k} if config is not None else {}
    if any(isinstance(v, float) and v > 0 for v in rates.values()):
        return "the training forward applies dropout"
    return None


def check_lag0(step: int, mean: float, tolerance: float, where: str, verdict: str) -> None:
    """A lag-0 step's mean |log q_engine − log q_trainer| of its trained tokens against τ (the module
    docstring): ``StaleEngineError`` past it under ``refuse``, a logged warning under ``warn``."""
    if not mean > tolerance:  # NaN (no rollout token) passes
        return
    message = (
        f"at step {step} the rollout engine at {where} sampled tokens whose log-probabilities differ from the "
        f"trainer's by {mean:.3g} on average, at lag 0, where the weights it was verified with give rounding "
        f"alone (tolerance {tolerance:.3g}): it samples with other weights than it was checked with (restarted at "
        "the same URL since the sync, stale only in its decode path, or a stale prefix cache)"
    )
    if verdict == "refuse":
        raise StaleEngineError(
            f"{message}. No update is made from these rollouts (opd.engine.dlogp_check: refuse); restart the engine "
            "and rerun, which resumes from the last checkpoint"
        )
    log.warning("%s (opd.engine.dlogp_check: warn)", message)
