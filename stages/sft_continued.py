"""sft_continued stage: OPD's control arm, more SFT from OPD's starting student with OPD's loop (see
ars_opd.training.sft)."""

from ars_opd.config import load_params
from stages import run_stage


def main() -> None:
    p = load_params(sections=("paths", "models", "ddp", "sft", "opd", "control"))
    from ars_opd.training.sft import run_sft_continued
    from ars_opd.training.worker import TrainingJob

    summary = run_sft_continued(TrainingJob.from_params("sft_continued", p))
    print(f"sft_continued: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, data {summary['data']}")


if __name__ == "__main__":
    run_stage(main)
