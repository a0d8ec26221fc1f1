#!/usr/bin/env bash
# Where OPD should win: the equal-budget study on the long-horizon task family (answers of 20-60 tokens
# written step by step; ars_opd/data/synthetic.py). Run from a clean checkout on a throwaway branch:
#     git switch -c long-horizon-study && bash bench/long_horizon_sweep.sh
# then copy reports/distillation.md and reports/distillation/long_horizon/ to your branch.
#
# 1. The base run: the whole pipeline on the family (the models stage trains the teacher on it), with
#    FRESH rows of the train split held back for the fresh control (control.fresh_rows), committed.
# 2. Its SFT student is pinned (paths.distill_init) as the one start of every arm, as in the default study.
# 3. Per training seed (ddp.seed), two experiments in the workspace: the control repeating the SFT stage's
#    rows (repeat) and the control on the held-back rows (fresh: new prompts, two epochs over them). OPD is the same run in both (DVC's run cache
#    restores it for the second), so each seed's OPD is compared with both controls.
# 4. `ars-opd distillation --family long-horizon` writes the family's section of reports/distillation.md.
set -euo pipefail
SEEDS="${SEEDS:-1 2 3 4 5}"
STEPS="${STEPS:-300}"               # each arm's steps (the opd loop)
BATCH="${BATCH:-32}"                # each arm's global batch
FRESH="${FRESH:-4800}"             # rows held back for the fresh control (it draws STEPS x BATCH: 2 epochs)
TEACHER_STEPS="${TEACHER_STEPS:-2000}"
INIT=data/study/long_horizon_sft_init
BASE=(
  -S 'synthetic.tasks=[running_sum,shift_steps]'
  -S "models.teacher_training.steps=$TEACHER_STEPS"
  -S "data.subset_size=$((2200 + FRESH))" -S "control.fresh_rows=$FRESH"
  -S teacher_gen.max_tokens=64 -S opd.max_new_tokens=64 -S evaluate.max_new_tokens=64
  -S "opd.steps=$STEPS" -S "opd.global_batch_size=$BATCH" -S opd.snapshot_every=50
)
t0=$(date +%s)
if [ ! -f "$INIT.dvc" ]; then
  dvc exp run "${BASE[@]}" -n long-horizon-base        # writes params.yaml in the workspace
  dvc exp apply long-horizon-base 2>/dev/null || true
  mkdir -p data/study && rm -rf "$INIT"
  cp -r data/sft/model "$INIT" && rm -rf "$INIT/snapshots"
  dvc add -q "$INIT"
  git add params.yaml dvc.lock "$INIT.dvc" data/study/.gitignore
  git commit -qm "long-horizon study: the base run and the fixed SFT start of every arm"
fi
echo "base: $(( $(date +%s) - t0 )) s" >&2
COMMON=(-S "paths.distill_init=$INIT" -S sft.steps=20 -S sft.warmup_steps=2 -S sft.snapshot_every=0
        -S evaluate.curve_examples=100)
for seed in $SEEDS; do
  dvc exp run "${COMMON[@]}" -S "ddp.seed=$seed" -S control.data=repeat -n "lh-repeat-seed$seed"
  dvc exp run "${COMMON[@]}" -S "ddp.seed=$seed" -S control.data=fresh -n "lh-fresh-seed$seed"
  echo "seed $seed: $(( $(date +%s) - t0 )) s" >&2
done
dvc exp show --json --all-commits > /tmp/long_horizon_exps.json
{ echo "git switch -c long-horizon-study && bash bench/long_horizon_sweep.sh   # SEEDS=\"$SEEDS\" STEPS=$STEPS BATCH=$BATCH"
  echo "# base run: ${BASE[*]}"
  echo "# every experiment: ${COMMON[*]} -S ddp.seed=<seed>"
  echo "# main study: -S control.data=repeat; fresh-control regime: -S control.data=fresh"
  echo "dvc exp show --json --all-commits > exps.json"
  echo "ars-opd distillation --from exps.json --out reports/distillation.md --family long-horizon \\"
  echo "  --where paths.distill_init=$INIT --where control.data=repeat \\"
  echo "  --regime 'fresh control (new prompts, each once):paths.distill_init=$INIT,control.data=fresh'"
} > /tmp/long_horizon_commands.txt
ars-opd distillation --from /tmp/long_horizon_exps.json --commands /tmp/long_horizon_commands.txt \
  --out reports/distillation.md --family long-horizon \
  --where "paths.distill_init=$INIT" --where control.data=repeat \
  --regime "fresh control (new prompts, each once):paths.distill_init=$INIT,control.data=fresh"
echo "study: $(( $(date +%s) - t0 )) s" >&2
