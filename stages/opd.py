"""opd stage: on-policy distillation of the SFT student from the teacher (see ars_opd.training.opd)."""

from ars_opd.config import load_params
from stages import run_stage


def main() -> None:
    p = load_params(sections=("paths", "models", "ddp", "opd", "control"))
    from ars_opd.training.opd import run_opd

    summary = run_opd(
        p.opd, p.ddp, p.paths, p.models.trust_remote_code, adapter=p.models.student_adapter, control=p.control
    )
    print(f"opd: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, data {summary['data']}")


if __name__ == "__main__":
    run_stage(main)
