#!/bin/bash
# One job on a machine with 2 GPUs: torch DDP and FSDP2 (the peer script) and fzero stages 0-3 on
# the same model, one torchrun job each, one JSON line each, written to ${OUT:-.}/bench.jsonl.
# Use: ARGS="--layers 24" bash benchmarks/run_gpu.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-.}/bench.jsonl
ngpu=${NGPU:-$(python3 -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
run() {  # name, script, args...
  local name=$1; shift
  timeout ${MODE_TIMEOUT:-300} python3 -m torch.distributed.run --standalone --nproc-per-node "$ngpu" "$@" ${ARGS:-} > "${OUT:-.}/$name.log" 2>&1
  grep '^{' "${OUT:-.}/$name.log" | tee -a "$out" || { echo "{\"mode\": \"$name\", \"error\": true}" | tee -a "$out"; tail -5 "${OUT:-.}/$name.log"; }
}
for m in ${PEERS:-ddp fsdp2}; do run "$m" "$here/peers/bench_peers.py" --mode "$m"; done
for s in ${STAGES:-0 1 2 3}; do run "fzero$s" "$here/bench_stages.py" --stage "$s"; done
for s in ${EAGER_STAGES:-3}; do run "fzero$s-eager" "$here/bench_stages.py" --stage "$s" --gather eager; done
for s in ${BF16_STAGES:-}; do run "fzero$s-bf16" "$here/bench_stages.py" --stage "$s" --precision bf16; done
