#!/usr/bin/env bash
# The GPU checks in one call, for a machine with a CUDA device (e.g. an H200).
# 1. a CUDA torch and Triton (installed from the package index when python3 has none),
# 2. the C extensions built in place, the CUDA tests (tests/optim/test_cuda.py, and tests/optim/test_triton.py,
#    which compares the Triton kernels with the eager reference on the GPU),
# 3. the step benchmark (Gefen with the Triton kernels and eager, and Gefen m8 with the kernels in
#    both second-moment forms, vs torch AdamW fused and foreach, ~1.75B parameters) in fp32 and bf16,
#    each in a fresh process with an empty Triton cache, so the first step includes compiling,
# 4. the CUDA section of docs/benchmarks.md (run_all --only cuda from this run's JSON).
# Everything lands in $OUT when set, else benchmarks/out: build.log, cuda_tests.log,
# cuda.json, cuda_bfloat16.json, cuda*.md, benchmarks.md, benchmarks.json.
#   run:  bash benchmarks/gpu.sh                 (under 8 minutes on one GPU)
#   GEFEN_GPU_MILLIONS=200 bash benchmarks/gpu.sh   a smaller parameter set
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/out}"
mkdir -p "$out"
py="${PYTHON:-python3}"
millions="${GEFEN_GPU_MILLIONS:-1750}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
started=$SECONDS
say() { echo "[gpu.sh $((SECONDS - started))s] $*"; }

# 1. what the checks need; the import test decides, pip runs only for what is missing
# torch: none -> install; a CPU-only build (torch.version.cuda is None) -> the same version's
# default build from the package index (CUDA on Linux); a CUDA build without a device -> stop
torch_state=$("$py" -c "import torch; print('cpu-build ' + torch.__version__ if torch.version.cuda is None else 'cuda')" 2>/dev/null || echo missing)
case "$torch_state" in
    missing)
        say "no torch in $py: installing torch from the package index"
        "$py" -m pip install -q "torch>=2.5" || { echo "gpu.sh: could not install torch" >&2; exit 1; } ;;
    cpu-build*)
        version="${torch_state#cpu-build }"
        say "torch ${version} in $py is a CPU build: installing torch==${version%%+*} (CUDA) from the package index"
        "$py" -m pip install -q --force-reinstall "torch==${version%%+*}" \
            || { echo "gpu.sh: could not install a CUDA torch" >&2; exit 1; } ;;
esac
missing=$("$py" - <<'PY'
import importlib.util
need = {"triton": "triton", "pytest": "pytest", "pytest_timeout": "pytest-timeout", "numpy": "numpy",
        "safetensors": "safetensors", "msgpack": "msgpack", "fsspec": "fsspec", "typer": "typer", "rich": "rich"}
print(" ".join(dist for mod, dist in need.items() if importlib.util.find_spec(mod) is None))
PY
)
if [ -n "$missing" ]; then
    say "installing $missing"
    # shellcheck disable=SC2086  # one word per distribution
    "$py" -m pip install -q $missing || say "could not install $missing: the steps that need them will say so"
fi
"$py" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"

# 2. C extensions (CPU reference in the tests) and the CUDA tests
"$py" setup.py -q build_ext --inplace >"$out/build.log" 2>&1 || say "C extensions not built (see build.log): eager CPU paths only"
say "CUDA tests"
timeout 240 "$py" -m pytest -q -p no:cacheprovider tests/optim/test_cuda.py tests/optim/test_triton.py \
    "tests/optim/test_native_step.py::test_cuda_uses_the_eager_path" 2>&1 | tee "$out/cuda_tests.log" || say "CUDA tests failed or timed out (see cuda_tests.log)"

# 3. the benchmark, one fresh process and an empty Triton cache per dtype
for dtype in float32 bfloat16; do
    suffix=$([ "$dtype" = float32 ] && echo "" || echo "_$dtype")
    say "benchmark $dtype"
    TRITON_CACHE_DIR="$(mktemp -d)" timeout 200 "$py" -m benchmarks.bench_cuda --out "$out" --dtype "$dtype" \
        --millions "$millions" | tee "$out/cuda$suffix.md" || say "benchmark $dtype failed or timed out"
done

# 4. the docs page's CUDA section from this run's JSON (no second measurement)
GEFEN_CUDA_RESULTS="$out" timeout 60 "$py" -m benchmarks.run_all --only cuda >"$out/run_all.log" 2>&1 \
    || say "run_all failed (see run_all.log)"
cp docs/benchmarks.md docs/benchmarks.json "$out/" 2>/dev/null || true
say "done: $out"
