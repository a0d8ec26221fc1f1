"""sft stage: fine-tune the student on the teacher's completions on DDP workers (see ars_opd.training.sft)."""

from ars_opd.config import load_params
from stages import run_stage


def main() -> None:
    p = load_params(sections=("paths", "models", "ddp", "sft", "control"))
    from ars_opd.training.sft import run_sft
    from ars_opd.training.worker import TrainingJob

    summary = run_sft(TrainingJob.from_params("sft", p))
    print(f"sft: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, data {summary['data']}")


if __name__ == "__main__":
    run_stage(main)
