"""models stage: shared tokenizer, teacher and student base, pinned in a manifest (see ars_opd.models.prepare)."""

from ars_opd.config import load_params
from stages import run_stage


def main() -> None:
    p = load_params(sections=("base", "paths", "synthetic", "models", "inputs"))
    from ars_opd.models.prepare import prepare_models

    metrics = prepare_models(p.base, p.models, p.synthetic, p.paths.models_dir, p.paths.models_metrics)
    if "teacher_exact_match" in metrics:
        print(
            f"teacher held-out exact match {metrics['teacher_exact_match']:.1%} "
            f"(student base {metrics['student_base_exact_match']:.1%})"
        )
    if "student_params" in metrics and "teacher_params" in metrics:
        print(f"teacher {metrics['teacher_params']:,} parameters, student {metrics['student_params']:,}")


if __name__ == "__main__":
    run_stage(main)
