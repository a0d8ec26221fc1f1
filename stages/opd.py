"""opd stage: on-policy distillation of the SFT student from the teacher (see ars_opd.training.opd)."""

from ars_opd.config import load_params
from stages import run_stage


def main() -> None:
    p = load_params(sections=("paths", "models", "ddp", "opd", "control", "teachers"))
    from ars_opd.training.opd.stage import run_opd
    from ars_opd.training.worker import TrainingJob

    summary = run_opd(TrainingJob.from_params("opd", p))
    print(f"opd: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, data {summary['data']}")


if __name__ == "__main__":
    run_stage(main)
