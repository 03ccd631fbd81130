#!/bin/bash
# One job on a GPU machine (NGPU GPUs, default all): torch DDP and FSDP2 with and without reshard
# (the peer script), fzero stages 0-3 (fp32 params, bf16 autocast), fzero with the bf16 policy
# (stages 2-3), all on the same model, one torchrun job each, one JSON line each, appended to
# ${OUT:-.}/bench.jsonl; then (PROFILE=1) a profiler table of one fzero step per PROFILE_STAGES
# (${OUT}/profile-stage<s>.txt) and of one step per PROFILE_PEERS (profile-<mode>.txt) and (CENSUS=1, one GPU) benchmarks/census.py's passes per step.
# Use: bash benchmarks/run_gpu.sh        (ARGS="--layers 4" to shrink the model; MODE_TIMEOUT s per mode;
#      ROUNDS=R to run the modes R times in turn)
# An empty list skips its modes (PEERS= STAGES= ...); PROFILE=0 / CENSUS=0 skip the profile / census.
# NOEARLY_STAGES / NOEARLY_BF16_STAGES add `--early 0` rows (the update launched after the read);
# NOASM_STAGES / NOASM_BF16_STAGES `--side-assembly 0` rows (the gradients assembled on the step's stream);
# CAST_STAGES `--cast-ahead 1` rows (train_step(cast_ahead=True): the params autocast casts, handed cast).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
here=$(cd "$(dirname "$0")" && pwd)
o=${OUT:-.}
out=$o/bench.jsonl
ngpu=${NGPU:-$(python3 -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
run() {  # name, script, args...
  local name=$1; shift
  timeout ${MODE_TIMEOUT:-300} python3 -m torch.distributed.run --standalone --nproc-per-node "$ngpu" "$@" ${ARGS:-} > "$o/$name.log" 2>&1
  grep '^{' "$o/$name.log" | tee -a "$out" || { echo "{\"mode\": \"$name\", \"error\": true}" | tee -a "$out"; tail -5 "$o/$name.log"; }
}
# ROUNDS=R runs every mode above R times in turn (peers, then fzero, R times over): the ratios of
# one round come from neighbouring runs, and R rounds show the spread on one machine
for round in $(seq "${ROUNDS:-1}"); do
  for m in ${PEERS-ddp fsdp2 fsdp2-noreshard}; do run "$m" "$here/peers/bench_peers.py" --mode "$m"; done
  for s in ${STAGES-0 1 2 3}; do run "fzero$s" "$here/bench_stages.py" --stage "$s"; done
  for s in ${EAGER_STAGES:-}; do run "fzero$s-eager" "$here/bench_stages.py" --stage "$s" --gather eager; done
  for s in ${BF16_STAGES-2 3}; do run "fzero$s-bf16" "$here/bench_stages.py" --stage "$s" --precision bf16; done
  # the same-job A/B of casting ahead (eleventh session)
  for s in ${CAST_STAGES:-}; do run "fzero$s-cast" "$here/bench_stages.py" --stage "$s" --cast-ahead 1; done
  # the same-job A/B of the update launched before the agreement's read (ninth session)
  for s in ${NOEARLY_STAGES:-}; do run "fzero$s-noearly" "$here/bench_stages.py" --stage "$s" --early 0; done
  # the same-job A/B of the gradients assembled beside the backward (tenth session)
  for s in ${NOASM_STAGES:-}; do run "fzero$s-noasm" "$here/bench_stages.py" --stage "$s" --side-assembly 0; done
  for s in ${NOASM_BF16_STAGES:-}; do
    run "fzero$s-bf16-noasm" "$here/bench_stages.py" --stage "$s" --precision bf16 --side-assembly 0
  done
  for s in ${NOEARLY_BF16_STAGES:-}; do
    run "fzero$s-bf16-noearly" "$here/bench_stages.py" --stage "$s" --precision bf16 --early 0
  done
done
if [ "${PROFILE:-1}" = 1 ]; then
  for s in ${PROFILE_STAGES-2}; do
    run "fzero$s-profile" "$here/bench_stages.py" --stage "$s" --steps 2 --warmup 2 --profile "$o/profile-stage$s.txt"
  done
  for m in ${PROFILE_PEERS-}; do
    run "$m-profile" "$here/peers/bench_peers.py" --mode "$m" --steps 2 --warmup 2 --profile "$o/profile-$m.txt"
  done
fi
if [ "${CENSUS:-1}" = 1 ] && [ "$ngpu" = 1 ] && python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  timeout ${CENSUS_TIMEOUT:-400} python3 -m torch.distributed.run --standalone --nproc-per-node 1 "$here/census.py" --gpt \
    > "$o/census.log" 2>&1; grep '^{' "$o/census.log" | tee -a "$o/census.jsonl" || tail -5 "$o/census.log"
fi
