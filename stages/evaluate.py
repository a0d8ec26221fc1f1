"""evaluate stage: base, SFT and OPD students and the teacher on held-out prompts (see ars_opd.evaluation.evaluate)."""

from ars_opd.config import load_params
from stages import run_stage


def main() -> None:
    p = load_params(sections=("paths", "models", "evaluate", "teachers"))
    from ars_opd.evaluation.evaluate import eval_table, evaluate_models

    print(eval_table(evaluate_models(p.evaluate, p.paths, p.models.trust_remote_code, p.teachers)))


if __name__ == "__main__":
    run_stage(main)
