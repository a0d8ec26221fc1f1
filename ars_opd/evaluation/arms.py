"""The models the evaluation compares and the arms of the equal-budget study (shared by evaluate and report)."""

from __future__ import annotations

from ars_opd.config import TRAINING_STAGES

TRAINED = TRAINING_STAGES  # models the training stages write (with budgets and snapshots)
MODELS = ("base", *TRAINED, "teacher")
ARMS = ("opd", "sft_continued")  # the arms that start from the SFT student with equal steps
