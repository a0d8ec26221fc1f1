"""models stage: the student's tokenizer (and with opd.cross_tokenizer the teacher's own), the teacher and the
student base, pinned in a manifest (see ars_opd.models.prepare).

It reads the teachers section for the named teachers it pins beside models.teacher (ars_opd.models.prepare_teachers),
and the opd section for one key, opd.cross_tokenizer: whether the pair may tokenise differently is decided
here, where the models are pinned, and loading the section lets check_params refuse a built-in model beside a
pretrained one without the flag before anything is built."""

from ars_opd.config import load_params
from stages import run_stage


def main() -> None:
    p = load_params(sections=("base", "paths", "synthetic", "models", "inputs", "opd", "teachers"))
    from ars_opd.models.prepare import prepare_models

    metrics = prepare_models(
        p.base,
        p.models,
        p.synthetic,
        p.paths.models_dir,
        p.paths.models_metrics,
        cross_tokenizer=p.opd.cross_tokenizer,
        teachers=p.teachers,
    )
    if "teacher_exact_match" in metrics:
        student = metrics.get("student_base_exact_match")
        print(
            f"teacher held-out exact match {metrics['teacher_exact_match']:.1%} "
            f"(student base {'n/a' if student is None else f'{student:.1%}'} "
            f"on {metrics.get('student_eval_examples', metrics['eval_examples'])} prompts)"
        )
    if "student_params" in metrics and "teacher_params" in metrics:
        print(f"teacher {metrics['teacher_params']:,} parameters, student {metrics['student_params']:,}")
    for name, m in (metrics.get("teachers") or {}).items():
        print(f"teacher {name}: {m['exact_match_own_tasks']:.1%} exact match on its tasks {', '.join(m['tasks'])}")
    if p.opd.cross_tokenizer:
        print(
            f"cross tokenizers: student vocabulary {metrics['tokenizer_vocab_size']:,}, "
            f"teacher {metrics['teacher_tokenizer_vocab_size']:,}"
        )


if __name__ == "__main__":
    run_stage(main)
