"""sft stage: fine-tune the student on the teacher's completions on DDP workers (see ars_opd.training.sft)."""

from ars_opd.config import load_params
from stages import run_stage


def main() -> None:
    p = load_params(sections=("paths", "models", "ddp", "sft", "control"))
    from ars_opd.training.sft import run_sft

    summary = run_sft(
        p.sft,
        p.ddp,
        p.paths,
        adapter=p.models.student_adapter,
        control=p.control,
        trust_remote_code=p.models.trust_remote_code,
    )
    print(f"sft: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, data {summary['data']}")


if __name__ == "__main__":
    run_stage(main)
