"""subset stage: load the instruction dataset, normalise to messages, seeded subset, train/eval split."""

from ars_opd.config import load_params
from stages import run_stage


def main() -> None:
    p = load_params(sections=("base", "paths", "synthetic", "data", "inputs"))
    from ars_opd.data.subset import write_subset

    stats = write_subset(p.base, p.data, p.synthetic, p.paths)
    print(
        f"subset: {stats['train']} train, {stats['eval']} eval rows "
        f"({stats['malformed']} malformed, {stats['duplicates_dropped']} duplicates dropped)"
    )


if __name__ == "__main__":
    run_stage(main)
