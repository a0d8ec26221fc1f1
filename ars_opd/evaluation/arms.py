"""The models the evaluation compares and the arms of the equal-budget study (shared by evaluate and report)."""

from __future__ import annotations

MODELS = ("base", "sft", "opd", "sft_continued", "teacher")
TRAINED = ("sft", "opd", "sft_continued")  # models the training stages write (with budgets and snapshots)
ARMS = ("opd", "sft_continued")  # the arms that start from the SFT student with equal steps
