"""Which rows of the teacher_gen train split a training stage trains on (``control`` in params.yaml).

By default every stage reads the whole train split: sft trains on its teacher completions, opd on its prompts,
and the control arm (sft_continued) on the same completions again. ``control.fresh_rows: N`` holds the last N
rows back from sft and opd, and ``control.data: fresh`` gives them to the control instead: the teacher's
completions of prompts neither SFT nor OPD saw, as a user with more teacher budget would buy them. The split is
by position, so the rows sft and opd read are the same whether the control repeats or takes fresh rows, and
one OPD run is compared with both controls.
"""

from __future__ import annotations

from ars_opd.artifacts import file_sha256, read_jsonl
from ars_opd.config import ConfigError, ControlConfig, PathsConfig


def train_rows(paths: PathsConfig, stage: str, control: ControlConfig) -> tuple[list[dict], dict]:
    """(the rows ``stage`` trains on, what identifies them in the checkpoint fingerprint)."""
    path = paths.completions("train")
    rows = read_jsonl(path)
    identity = {"rows": len(rows), "data": file_sha256(path)}
    held = control.fresh_rows
    if not held:
        return rows, identity
    if held >= len(rows):
        raise ConfigError(
            "control.fresh_rows",
            f"holds back {held} of the train split's {len(rows)} rows ({path}) and leaves sft and opd none; "
            "raise data.subset_size by the rows held back",
        )
    fresh = stage == "sft_continued" and control.data == "fresh"
    identity["held_back"] = {"rows": held, "trains_on": "held back" if fresh else "the rest"}
    return (rows[-held:] if fresh else rows[:-held]), identity
