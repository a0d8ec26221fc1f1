#!/usr/bin/env bash
# Did OPD beat more SFT at equal budget? A `dvc exp run --queue` sweep of training seeds (ddp.seed: the
# models, data and teacher completions are shared and not rerun); `ars-opd distillation` then writes
# reports/distillation.md (means, 95% intervals, paired differences, a positive control, learning curves).
#
# Main study: the default arms (opd.steps 300 from the default SFT student), SEEDS seeds. Two regimes where
# OPD might be expected to do better, REGIME_SEEDS seeds each: a longer training horizon (opd.steps 1000
# for both arms) and a weaker start (the SFT student after 250 of its 1000 steps: a larger teacher-student
# gap). Every arm starts from a fixed SFT student (paths.distill_init), so the arms' differences are not
# SFT's; the sft stage still runs per seed (ddp.seed is one of its params), shortened since nothing reads it.
# Every run scores its learning curves on all held-out prompts, with snapshots every 50 (100) steps.
#
# Run from a clean checkout after `dvc repro` (its SFT student and its 250-step snapshot become the fixed
# starts). They are committed as DVC-tracked copies on a throwaway branch, since queued experiments see only
# committed files:
#     git switch -c distill-study && bash studies/distillation_sweep.sh
# then copy reports/distillation.md and reports/distillation/ to your branch.
set -euo pipefail
source "$(dirname "$0")/dvc_queue.sh"
SEEDS="${SEEDS:-1 2 3 4 5}"
REGIME_SEEDS="${REGIME_SEEDS:-1 2 3}"
INIT=data/study/sft_init
WEAK=data/study/sft_init_250
if [ ! -f "$INIT.dvc" ]; then
  mkdir -p data/study && rm -rf "$INIT" "$WEAK"
  cp -r data/sft/model "$INIT" && rm -rf "$INIT/snapshots"
  cp -r data/sft/model/snapshots/step_0000250 "$WEAK"
  dvc add -q "$INIT" "$WEAK"
  git add "$INIT.dvc" "$WEAK.dvc" data/study/.gitignore
  git commit -qm "distillation study: the fixed SFT starts of every arm"
fi
COMMON=(-S sft.steps=20 -S sft.warmup_steps=2 -S sft.snapshot_every=0 -S evaluate.curve_examples=0)
for seed in $REGIME_SEEDS; do
  dvc exp run --queue "${COMMON[@]}" -S "paths.distill_init=$INIT" -S opd.steps=1000 -S opd.snapshot_every=100 \
    -S "ddp.seed=$seed" -n "long-seed$seed"
  dvc exp run --queue "${COMMON[@]}" -S "paths.distill_init=$WEAK" -S opd.snapshot_every=50 -S "ddp.seed=$seed" \
    -n "weak-seed$seed"
done
for seed in $SEEDS; do
  dvc exp run --queue "${COMMON[@]}" -S "paths.distill_init=$INIT" -S opd.snapshot_every=50 -S "ddp.seed=$seed" \
    -n "distill-seed$seed"
done
run_queue
dvc exp show --json --all-commits > /tmp/distill_exps.json
{ echo "git switch -c distill-study && bash studies/distillation_sweep.sh   # SEEDS=\"$SEEDS\" REGIME_SEEDS=\"$REGIME_SEEDS\""
  echo "# every experiment: ${COMMON[*]} -S ddp.seed=<seed>"
  echo "# main study:      -S paths.distill_init=$INIT -S opd.snapshot_every=50"
  echo "# longer horizon:  -S paths.distill_init=$INIT -S opd.steps=1000 -S opd.snapshot_every=100"
  echo "# weaker start:    -S paths.distill_init=$WEAK -S opd.snapshot_every=50"
  echo "dvc exp show --json --all-commits > exps.json"
  echo "ars-opd distillation --from exps.json --out reports/distillation.md \\"
  echo "  --where paths.distill_init=$INIT --where opd.steps=300 \\"
  echo "  --regime 'longer horizon (1000 steps per arm):opd.steps=1000' \\"
  echo "  --regime 'weaker start (SFT after 250 steps):paths.distill_init=$WEAK'"; } > /tmp/distillation_commands.txt
ars-opd distillation --from /tmp/distill_exps.json --commands /tmp/distillation_commands.txt \
  --out reports/distillation.md --where "paths.distill_init=$INIT" --where opd.steps=300 \
  --regime "longer horizon (1000 steps per arm):opd.steps=1000" \
  --regime "weaker start (SFT after 250 steps):paths.distill_init=$WEAK"
