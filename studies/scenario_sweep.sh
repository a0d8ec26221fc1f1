#!/usr/bin/env bash
# The replicated seed-scenario study as a `dvc exp run --queue` grid; `ars-opd scenarios` then writes
# reports/scenarios.md from `dvc exp show --json`.
#
# K = 4 workers (with 2, "rank 0's seed differs" and "every rank's seed differs" are the same experiment);
# S1-1, S1-2, S1-3 with SEEDS training seeds each (ddp.seed: the models and data stages are not rerun),
# plus a positive control: shard_skew on rank 1 from step 0 (rank 1 sees a single task) in both training
# stages. Every experiment's opd (and its control arm, sft_continued) starts from one fixed SFT student
# (paths.distill_init), so OPD's differences are not SFT's. Shortened steps keep the grid under an hour on
# two CPU cores. (The distillation seed sweep is studies/distillation_sweep.sh.)
#
# Run from a clean checkout after `dvc repro` (its SFT student becomes the fixed OPD init). The init is
# committed as a DVC-tracked copy on a throwaway branch, since queued experiments see only committed files:
#     git switch -c scenario-study && bash studies/scenario_sweep.sh
# then copy reports/scenarios.md to your branch.
set -euo pipefail
source "$(dirname "$0")/dvc_queue.sh"
SEEDS="${SEEDS:-1 2 3 4 5}"
INIT=data/study/sft_init
if [ ! -f "$INIT.dvc" ]; then
  mkdir -p data/study && rm -rf "$INIT" && cp -r data/sft/model "$INIT"
  dvc add -q "$INIT"
  git add "$INIT.dvc" data/study/.gitignore && git commit -qm "scenario study: the fixed SFT init of every OPD run"
fi
COMMON=(-S ddp.workers=4 -S sft.micro_batch_size=8 -S opd.micro_batch_size=8 -S sft.steps=100 -S sft.warmup_steps=10
        -S sft.snapshot_every=0 -S opd.steps=40 -S opd.warmup_steps=4 -S opd.snapshot_every=20
        -S evaluate.max_examples=40 -S evaluate.curve_examples=40 -S "paths.distill_init=$INIT")
for seed in $SEEDS; do
  for sc in S1-1 S1-2 S1-3; do
    dvc exp run --queue "${COMMON[@]}" -S "ddp.scenario=$sc" -S "ddp.seed=$seed" -n "$(echo "$sc" | tr 'A-Z' 'a-z')-seed$seed"
  done
  dvc exp run --queue "${COMMON[@]}" -S ddp.scenario=S1-1 -S "ddp.seed=$seed" -S ddp.inject.kind=shard_skew \
    -S ddp.inject.magnitude=1.0 -S ddp.inject.start_step=0 -S 'ddp.inject.stages=[sft,opd]' -n "control-seed$seed"
done
run_queue
dvc exp show --json --all-commits > /tmp/scenario_exps.json
ars-opd scenarios --from /tmp/scenario_exps.json --notes reports/scenarios_notes.md --out reports/scenarios.md
