#!/usr/bin/env bash
# The checks of one NVIDIA GPU host, in one run, in this order, each stage under its own time
# limit, writing its results to OUT_DIR as it ends (a run cut short keeps what it measured):
#   0. the wheels the host lacks, from .whl/ (grain, array_record, tensorboardX, portpicker,
#      zstandard; tokamax and what it imports, for its peer rows;
#      flax and orbax-checkpoint from .whl/maybe/ only where the host's are outside
#      pyproject.toml's ranges), then versions and nvidia-smi;
#   1. `python -m flaxattn.selftest --quick` (its output in this script's) beside the GPU tests (tests/test_pallas_gpu.py,
#      test_mosaic_gpu.py, test_cudnn.py, test_bench_gpu.py, test_split_k.py; junit XML in
#      tests.xml; GPU_CHECK_TESTS_S, default 240, the time limit of each: on an H200 the
#      tests alone took 158 s with -n 8);
#   2. `python -m bench.gpu` at 32K with --tilings (gpu.json; GPU_CHECK_BENCH_S, default 200,
#      its time limit);
#   3. `python -m bench.gpu_goals` (goals.json), then `python -m bench.masks` at 32K
#      (masks.json: MaskMod against the built-ins, FlexAttention where torch has CUDA;
#      GPU_CHECK_MASKS_S, default 120, its time limit);
#   decode. `python -m bench.gpu --decode` alone (decode.json: the layer's decode step at 32K
#      and 128K against the bandwidth floor, goal at most 2x; GPU_CHECK_DECODE_S, default 150,
#      its time limit), then `python -m bench.decode --generate` (decode_generate.json:
#      train.sample.generate's time per token against its step dispatched from Python);
#   4. the trainer, `python -m train configs/gpu_demo.yaml steps=60` (GPU_CHECK_TRAINER_STEPS),
#      its log with each
#      line's seconds since this script started (trainer.log), its metrics.jsonl;
#   5. with the time left (GPU_CHECK_BUDGET_S, default 420, counted from the start), the
#      README's test command with -n 8 (suite.xml).
#   bash bench/gpu_check.sh OUT_DIR [STAGE ...]     (default stages: 1 2 3 decode 4 5)
# GPU_CHECK_WHEELS=0 skips step 0's installs. check.json holds each stage's exit status and seconds. Without a GPU, stages 1-4 still run
# (the benches say why they measure nothing; bench.decode --generate measures the CPU), which
# rehearses the script.
set -u
out=${1:?usage: bash bench/gpu_check.sh OUT_DIR [STAGE ...]}
shift
stages=${*:-1 2 3 decode 4 5}
mkdir -p "$out"
cd "$(dirname "$0")/.."
t0=$(date +%s.%N)
budget=${GPU_CHECK_BUDGET_S:-420}
python=${PYTHON:-python3}
since() { "$python" -c "import sys; print(f'{float(sys.argv[1]) - float(sys.argv[2]):.1f}')" \
  "$(date +%s.%N)" "$t0"; }
summary="$out/check.json"
echo "{}" >"$summary"
record() {  # record STAGE RC SECONDS
  "$python" - "$summary" "$1" "$2" "$3" <<'EOF'
import json, sys
path, stage, rc, seconds = sys.argv[1:]
data = json.load(open(path))
data[stage] = dict(rc=int(rc), seconds=float(seconds))
json.dump(data, open(path, "w"), indent=1)
EOF
}
stage() {  # stage NAME LIMIT_S COMMAND...: run under a time limit, record it
  local name=$1 limit=$2
  shift 2
  local s
  s=$(date +%s.%N)
  echo "=== stage $name (limit ${limit}s) at $(since)s: $*"
  timeout --signal=INT --kill-after=15 "$limit" "$@"
  local rc=$?
  local took
  took=$("$python" -c "import sys; print(f'{float(sys.argv[1]) - float(sys.argv[2]):.1f}')" \
    "$(date +%s.%N)" "$s")
  echo "=== stage $name: exit $rc in ${took}s"
  record "$name" "$rc" "$took"
}
has() { [[ " $stages " == *" $1 "* ]]; }

# --- 0. Wheels and versions --------------------------------------------------------------------
if [ "${GPU_CHECK_WHEELS:-1}" = 1 ] && compgen -G ".whl/*.whl" >/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  for pkg in "flax 0.12 0.13" "orbax-checkpoint 0.12 0.13"; do
    set -- $pkg
    if ! "$python" - "$1" "$2" "$3" <<'EOF'
import sys
from importlib.metadata import version
name, low, high = sys.argv[1:]
v = tuple(int(p) for p in version(name).split(".")[:2])
sys.exit(0 if tuple(map(int, low.split("."))) <= v < tuple(map(int, high.split("."))) else 1)
EOF
    then
      "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/maybe/"${1//-/_}"-*.whl && echo "installed the carried $1"
    fi
  done
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
"$python" -c "
from importlib.metadata import version
import jax
print('python', __import__('sys').version.split()[0], *(f'{p} {version(p)}' for p in
      ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'grain', 'triton', 'torch')))
print('devices', jax.devices(), [d.device_kind for d in jax.devices()])"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv \
  2>/dev/null || true
echo "setup done at $(since)s"

# --- 1. Self-test and the GPU tests, side by side (correctness only: no timings kept) -------------
if has 1; then
  XLA_PYTHON_CLIENT_PREALLOCATE=false stage selftest "${GPU_CHECK_TESTS_S:-240}" "$python" -m flaxattn.selftest \
    --quick >/tmp/selftest.txt 2>&1 &
  # GPU_CHECK_TESTS: other pytest arguments (e.g. test ids to rerun)
  XLA_PYTHON_CLIENT_PREALLOCATE=false stage gpu_tests "${GPU_CHECK_TESTS_S:-240}" "$python" -m pytest -q -n 6 \
    -p no:cacheprovider --junitxml="$out/tests.xml" ${GPU_CHECK_TESTS:-tests/test_pallas_gpu.py \
    tests/test_mosaic_gpu.py tests/test_cudnn.py tests/test_bench_gpu.py tests/test_split_k.py}
  wait
  echo "--- selftest:"; cat /tmp/selftest.txt
fi

# --- 2. and 3. The benchmarks, alone on the GPU ------------------------------------------------
if has 2; then
  stage bench_gpu "${GPU_CHECK_BENCH_S:-200}" "$python" -m bench.gpu --lengths 32768 --tilings \
    --trainer-steps 0 --rows ${GPU_CHECK_ROWS:-pallas_gpu mosaic_gpu cudnn auto jax_nn_cudnn \
    docs_as_rows tokamax_mosaic torch_sdpa} \
    --json "$out/gpu.json"
fi
if has 3; then
  stage gpu_goals 100 "$python" -m bench.gpu_goals --json "$out/goals.json"
  # Programmable masks on the GPU's kernels against the built-ins, and FlexAttention where
  # the host's torch has CUDA (GPU_CHECK_MASKS_S, default 120).
  stage masks "${GPU_CHECK_MASKS_S:-120}" "$python" -m bench.masks --lengths 32768 \
    --build-lengths 131072 --repeats 3 --json "$out/masks.json"
fi

# --- decode. The decode step against the bandwidth floor; generate against its own step ---------
if has decode; then
  stage decode "${GPU_CHECK_DECODE_S:-150}" "$python" -m bench.gpu --decode --rows \
    --trainer-steps 0 --json "$out/decode.json"
  stage generate 120 "$python" -m bench.decode --generate --json "$out/decode_generate.json"
fi

# --- 4. The trainer: time to its first log line, steps, MFU -------------------------------------
if has 4; then
  run_dir=$(mktemp -d)/gpu_demo
  stamp="import sys, time
t0 = float(sys.argv[1])
for line in sys.stdin:
  print(f'{time.time() - t0:7.1f} {line}', end='', flush=True)"
  stage trainer 150 bash -c "set -o pipefail; '$python' -m train configs/gpu_demo.yaml \
    steps=${GPU_CHECK_TRAINER_STEPS:-60} run_dir='$run_dir' 2>&1 | '$python' -c \"\$0\" '$t0' >'$out/trainer.log'" \
    "$stamp"
  tail -15 "$out/trainer.log"
  cp "$run_dir/metrics.jsonl" "$out/metrics.jsonl" 2>/dev/null || true
fi

# --- 5. The whole suite with what is left of the budget ----------------------------------------
if has 5; then
  left=$("$python" -c "import sys; print(int($budget - float(sys.argv[1])))" "$(since)")
  if [ "$left" -gt 60 ]; then
    XLA_PYTHON_CLIENT_PREALLOCATE=false stage suite "$left" "$python" -m pytest -q -n 8 \
      -p no:cacheprovider --junitxml="$out/suite.xml" 2>&1 | tail -40
  else
    echo "suite: ${left}s left of ${budget}s, not run"
  fi
fi
echo "gpu_check done at $(since)s"
cat "$summary"
