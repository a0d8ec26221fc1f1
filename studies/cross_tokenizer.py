"""The cross-tokenizer study: the built-in character-level teacher distils the pruned SmolLM2 student (a BPE
tokenizer it does not share) on the built-in tasks, by OPD across tokenizers against continued SFT at equal steps
and equal FLOPs, over paired training seeds.

One command, the pruned-recovery study's runner (``studies/pruned_recovery.py``) with this study's settings: the
profile ``profiles/cross_tokenizer.yaml``, a start made here by the pipeline's own stages (models with
``opd.cross_tokenizer``, subset, teacher_gen from the built-in teacher, SFT of the student on its completions), the
control (``sft_continued``) and the two cross-tokenizer arms (``xtok_sampled``: span sampled-token reverse KL;
``xtok_vocab``: shared vocabulary + ULD) per seed, each evaluated against its seed's control. Any of the runner's
options may follow and override these (e.g. ``--seeds 1 --steps 10`` for a quick look, ``--jobs 2``).

    python studies/cross_tokenizer.py                      # reports/cross_tokenizer.md
    python studies/cross_tokenizer.py --report-only        # the page again from build/cross-tokenizer
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "studies"))

import pruned_recovery  # noqa: E402

DEFAULTS = [
    "--prepare",
    "--own-data",
    "--profile",
    "profiles/cross_tokenizer.yaml",
    "--arms",
    "sft",
    "xtok_sampled",
    "xtok_vocab",
    "--steps",
    "60",
    "--snapshot-every",
    "20",
    "--root",
    "build/cross-tokenizer",
    "--out",
    "reports/cross_tokenizer.md",
    "--title",
    "# On-policy distillation across tokenizers: a character-level teacher, a BPE student",
]


def main(argv: list[str] | None = None) -> int:
    """The runner with this study's defaults first, so that options given here override them (argparse keeps the
    last value of an option)."""
    return pruned_recovery.main(DEFAULTS + list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
