#!/usr/bin/env bash
# Issue 6's GPU checks in one call, for a machine with a CUDA device (the device tool's H200:
# python3 there holds a CUDA torch; nothing can be fetched). Builds the C extensions in place,
# runs the CUDA tests, then the CUDA step benchmark in fp32 and bf16. Everything lands in $OUT
# (the device tool's folder) or benchmarks/out: cuda_tests.log, cuda*.json, cuda*.md.
#   device run:  bash benchmarks/gpu.sh          (about 2-4 minutes on an H200)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace >"$out/build.log" 2>&1 || echo "C extensions not built (see build.log): eager paths only"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py "tests/test_native_step.py::test_cuda_uses_the_eager_path" 2>&1 | tee "$out/cuda_tests.log" || true
python3 -m benchmarks.bench_cuda --out "$out" | tee "$out/cuda.md"
python3 -m benchmarks.bench_cuda --out "$out" --dtype bfloat16 | tee "$out/cuda_bfloat16.md"
