"""teacher_gen stage: a teacher completion for every prompt, through an OpenAI-compatible endpoint (with several
teachers, each prompt's own: the teachers section)."""

from ars_opd.config import load_params
from stages import run_stage


def main() -> None:
    p = load_params(sections=("paths", "teacher_gen", "teachers"))
    from ars_opd.teacher.client.generate import generate_teacher_completions

    m = generate_teacher_completions(p.teacher_gen, p.paths, teachers=p.teachers)
    print(
        f"teacher_gen: {m['prompts']} prompts, {m['cached_before_run']} cached, {m['answered']} answered now, "
        f"{m['failed']} without an answer {m['failures_by_reason'] or ''}"
    )


if __name__ == "__main__":
    run_stage(main)
