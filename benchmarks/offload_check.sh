#!/bin/bash
# One call on the one-GPU machine for the NVMe placement (master and stage-3 shards in swap files):
# the CUDA copies out of the swap buffers checked bit for bit against the "cpu" tier
# (offload_gpu.py's NVMe rows, `equal_to_cpu_tier`), the CUDA-only offload tests, then fzero's
# NVMe modes at the largest size the disk guard allows (bench_offload.py, 3 steps each).
# optree is not on that image: carry its cp312 wheel in .whl/.
# Use (on the device machine, from the repository root):  OUT=/tmp/o bash benchmarks/offload_check.sh
set -u -o pipefail
out=${OUT:-.}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L; df -h /tmp | tail -1; free -g | head -2
timeout ${CHECK_TIMEOUT:-150} python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/offload_gpu.py \
  --steps 3 --budget ${CHECK_BUDGET:-85} --nvme-path /tmp --out "$out/offload-gpu.jsonl" > "$out/offload-gpu.log" 2>&1
echo "offload_gpu exit $?"; grep -E '"row": "(step|kernel_bound)"' "$out/offload-gpu.log"
timeout ${TEST_TIMEOUT:-120} python3 -m pytest -q -p no:cacheprovider -p no:benchmark -k cuda \
  tests/test_shed.py tests/test_nvme.py tests/test_offload.py > "$out/tests-cuda.log" 2>&1
echo "pytest -k cuda exit $?"; tail -3 "$out/tests-cuda.log"
if [ -n "${NVME_SIZES-x}" ]; then
  timeout ${BENCH_TIMEOUT:-330} python3 benchmarks/bench_offload.py --skip-pcie --skip-adam --steps 2 \
    --modes fzero-nvme fzero-nvme-params \
    --mode-sizes ${NVME_SIZES:-fzero-nvme=4096x19,4096x16,4096x12 fzero-nvme-params=4096x16,4096x12,2048x8} \
    --total ${BENCH_TOTAL:-300} --run-timeout ${RUN_TIMEOUT:-170} --nvme-path /tmp/fzero-bench-nvme \
    --out "$out/offload-nvme.jsonl" > "$out/offload-nvme.log" 2>&1
  echo "bench_offload exit $?"; grep '^{' "$out/offload-nvme.log" | grep -v '"bench": "train".*"error"' | tail -8
fi
