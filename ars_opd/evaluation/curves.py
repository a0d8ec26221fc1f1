"""The learning curves of the evaluate stage: every snapshot a training stage kept (``snapshot_every``) and its
final model, scored on the first ``evaluate.curve_examples`` held-out prompts, with the steps and FLOPs spent
from scratch to reach it (``ars_opd.training.budget``); each arm's curve begins at the student both arms start
from. The equal-budget comparisons read the arms off these curves at any budget between their start and end
(``ars_opd.evaluation.equal_budget``). ``CurveScorer`` scores them; DVCLive writes them for ``dvc plots``
too (``log_curves``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ars_opd.config import EvaluateConfig, PathsConfig
from ars_opd.evaluation.arms import ARMS, TRAINED
from ars_opd.evaluation.held_out import HeldOut
from ars_opd.evaluation.score_cache import ScoreCache, dir_sha256
from ars_opd.evaluation.scoring import score_model, scored
from ars_opd.models.loading import load_model_dir
from ars_opd.training.budget import SNAPSHOTS, read_budget

# what each learning-curve point records (the equal-FLOPs views read these off the curves)
CURVE_METRICS = (
    "exact_match",
    "reverse_kl",
    "teacher_nll",
    "exact_match_sampled",
    "reverse_kl_fixed_prefix",
    "reverse_kl_first_sentence",
    "reverse_kl_per_sequence",
)


@dataclass(frozen=True)
class CurveScorer:
    """What every learning-curve point is scored with: the teacher (and its tokenizer when it is not the
    student's), the held-out ``data`` (the curve's subset), the evaluate config, the vocabulary both share,
    the device and the score store."""

    teacher: Any
    tokenizer: Any
    data: HeldOut
    cfg: EvaluateConfig
    vocab: int
    device: torch.device
    trust_remote_code: bool = False
    cache: ScoreCache | None = None
    teacher_tokenizer: Any = None

    def point(self, model_dir: Path, stage: str) -> dict:
        """One learning-curve point: the model in ``model_dir`` scored on ``data``, with its budget."""

        def compute() -> tuple[dict, list[str]]:
            model = load_model_dir(model_dir, stage=stage, trust_remote_code=self.trust_remote_code)
            model = model.to(self.device).eval().requires_grad_(False)
            return score_model(
                model,
                self.teacher,
                self.tokenizer,
                self.data,
                self.cfg,
                self.vocab,
                self.device,
                teacher_tokenizer=self.teacher_tokenizer,
            )

        m, _ = scored(self.cache, lambda: f"dir:{dir_sha256(model_dir)}", self.data, False, compute)
        point = {**read_budget(model_dir), **{k: m.get(k) for k in CURVE_METRICS}}
        if "per_teacher" in m:  # several teachers: each teacher's rows too, for comparisons at equal budget per teacher
            point["per_teacher"] = m["per_teacher"]
        return point

    def curve(self, stage: str, paths: PathsConfig) -> list[dict]:
        """A training stage's snapshots (``snapshots/step_N`` in its model directory) and its final model, each
        scored on ``data``, with the budget spent to reach it (``budget.json``: steps and FLOPs from scratch).
        A snapshot taken at the final step is the final model and is scored once."""
        model_dir = Path(paths.training(stage).model)
        final_steps = read_budget(model_dir)["steps"]
        dirs = [d for d in sorted((model_dir / SNAPSHOTS).glob("step_*")) if read_budget(d)["steps"] != final_steps]
        return [self.point(d, stage) for d in dirs + [model_dir]]

    def curves(self, paths: PathsConfig) -> dict:
        """Every training stage's curve; each arm's curve starts at the student both arms start from
        (``paths.distill_init``), so the arms can be read off at any budget between their start and end (the
        equal-FLOPs comparison interpolates there). When that student is the sft stage's model its final curve
        point is reused rather than scored again."""
        curves = {stage: self.curve(stage, paths) for stage in TRAINED}
        init = Path(paths.distill_init)
        if init.resolve() == Path(paths.sft_model).resolve():
            start = dict(curves["sft"][-1])
        else:
            start = self.point(init, "sft")
        for arm in ARMS:
            curves[arm] = [{**start, "start": True}] + curves[arm]
        return curves


def log_curves(live_dir: Path, curves: dict) -> None:
    """The learning curves through DVCLive, for ``dvc plots show``/``dvc plots diff``: one series per training
    stage and metric (and its FLOPs from scratch) against optimiser steps from scratch. Only the plot files:
    the numbers are in the evaluate metrics already."""
    from dvclive import Live

    live = Live(dir=str(live_dir), save_dvc_exp=False, dvcyaml=None, resume=False)
    for stage in TRAINED:
        for point in curves.get(stage) or []:
            live.step = int(point["steps"])
            for key in (*CURVE_METRICS, "flops"):
                v = point.get(key)
                if isinstance(v, (int, float)) and math.isfinite(v):
                    live.log_metric(f"{stage}/{key}", float(v), plot=True)
