#!/bin/bash
# One call on the GPU machine (torch 2.11 there): the test suite with CUDA hidden (gloo workers,
# CPU tensors: the torch version the project also supports), then the optimizer-kernel benchmark
# on CUDA. optree is not on that image: carry its cp312 wheel in .whl/ (see benchmarks/README).
# Use (on the device machine, from the repository root):  bash benchmarks/gpu_check.sh
set -u -o pipefail
out=${OUT:-.}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L; python3 -c 'import torch, optree; print("torch", torch.__version__, "optree", optree.__version__)'
CUDA_VISIBLE_DEVICES= timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -x -p no:cacheprovider -n ${WORKERS:-6} \
  > "$out/tests-torch211.log" 2>&1; echo "pytest exit $?"; tail -6 "$out/tests-torch211.log"
timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_optim.py ${OPTIM_ARGS:-} 2>&1 | tee "$out/bench_optim.jsonl" | tail -14
