#!/usr/bin/env bash
# The validation-split sweep of docs/BENCHMARKS.md ("Twenty RL settings at the main job's budget"), as run on one
# H100 on 2026-11-26 (two batches of runs at once: the first twelve, then the eight gpb* ones with EVERY=25).
# Each run: the quickstart SFT start of seed 0, serial mode at lag 1, ~11,200 trajectories, val evaluations only.
# Usage: WALL=360 EVERY=50 benchmarks/results/gpu_h100/quickstart_val_sweep.sh; results in /tmp/sweep/*/summary.json
set -u
export OMP_NUM_THREADS=1
WALL=${WALL:-360}
COMMON="policy.path=checkpoints/qs_sft_s0 run.mode=serial run.serial_lag=1 run.eval_split=val env.num_val_init_states=50
 run.eval_every=${EVERY:-50} run.target_success=null learner.precision=fp32 run.max_wall_s=$WALL run.out_dir=/tmp/sweep
 run.checkpoint_every=100000"
declare -A V=(
  [base]="run.max_versions=350"
  [lr075]="run.max_versions=350 learner.lr=7.5e-5"
  [lr3]="run.max_versions=350 learner.lr=3e-4"
  [t10]="run.max_versions=350 actor.temperature=1.0"
  [t13]="run.max_versions=350 actor.temperature=1.3"
  [k4]="run.max_versions=350 learner.minibatches=4 learner.micro_batch_trajectories=8"
  [gpb8]="run.max_versions=175 buffer.groups_per_batch=8"
  [train20k]="run.max_versions=350 env.num_train_init_states=20000"
  [g16]="run.max_versions=175 actor.group_size=16"
  [seqmean]="run.max_versions=350 loss.aggregation=seq_mean_token_mean"
  [nods]="run.max_versions=350 buffer.dynamic_sampling=false"
  [eps3]="run.max_versions=350 loss.eps_low=0.3 loss.eps_high=0.4"
  [gpb8_b]="run.max_versions=175 buffer.groups_per_batch=8"
  [gpb8_lr3]="run.max_versions=175 buffer.groups_per_batch=8 learner.lr=3e-4"
  [gpb8_seq]="run.max_versions=175 buffer.groups_per_batch=8 loss.aggregation=seq_mean_token_mean"
  [gpb16]="run.max_versions=88 buffer.groups_per_batch=16"
  [gpb16_lr3]="run.max_versions=88 buffer.groups_per_batch=16 learner.lr=3e-4"
  [gpb8_k2]="run.max_versions=175 buffer.groups_per_batch=8 learner.minibatches=2"
  [gpb8_t13]="run.max_versions=175 buffer.groups_per_batch=8 actor.temperature=1.3"
  [gpb8_eps3]="run.max_versions=175 buffer.groups_per_batch=8 loss.eps_low=0.3 loss.eps_high=0.4"
)
for n in "${!V[@]}"; do
  timeout $((WALL + 90)) bin/train configs/quickstart.yaml $COMMON run.name=$n ${V[$n]} > /tmp/sweep_$n.log 2>&1 &
done
wait
