"""report stage: consistency report and distillation verdict (see ars_opd.evaluation.report)."""

from ars_opd.config import load_params
from stages import run_stage


def main() -> None:
    p = load_params(sections=("paths", "report"))
    from ars_opd.evaluation.report import write_report

    flat = write_report(p.report, p.paths)
    alarms = {k.split("/")[0]: v for k, v in flat.items() if k.endswith("/alarms")}
    print(f"report: {p.paths.report_md} (detector alarms: {alarms or 'none'})")


if __name__ == "__main__":
    run_stage(main)
