#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one go: the GPU-only tests (Triton kernels, CUDA-graph
# decoding, bf16 training, every model kind and attention backend on CUDA against the CPU),
# the rest of the test suite under that machine's torch, then decoding a 1.1B model in
# bfloat16 against transformers, bf16 training MFU, and the attention kernels' memory and
# time. Each part runs under its own time limit (seconds, in the second column) so one stuck
# part does not take the others down; each part's full output goes to $OUT/<part>.log
# (default ./gpu-logs), the last lines of it to stdout.
#
#   bash benchmarks/gpu.sh                 # every part
#   bash benchmarks/gpu.sh decode mfu      # some parts
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}

part() {  # name, time limit (s), command...
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit} s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - start)) s"
    tail -n "${TAIL:-25}" "$OUT/$name.log"
}

PARTS="$*"
want() { [ -z "$PARTS" ] || [[ " $PARTS " == *" $1 "* ]]; }
# the GPU tests in 8 processes where pytest-xdist is installed (Triton autotunes, inductor
# compiles)
XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n 8")

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton',
triton.__version__, 'transformers', transformers.__version__)"

want tests && part tests 240 $PY -m pytest -q $XDIST tests/test_gpu.py tests/test_flash_triton.py
# the CPU tests in 12 processes: they check the machine's torch and transformers, not CI's
want suite && part suite 420 $PY -m pytest -q ${XDIST:+-n 12} --ignore tests/test_gpu.py \
    --ignore tests/test_flash_triton.py
want decode && part decode 270 $PY benchmarks/vs_transformers.py --device cuda \
    --dtype bfloat16 --size 1b --repeats 3
want mfu && part mfu 200 $PY benchmarks/mfu.py --device cuda --compile --no-eager \
    --presets demo llama-30m gpt2 --warmup 3 --chunks 3 --steps 10
want flash && part flash 80 $PY benchmarks/flash_attention.py --device cuda --dtype bfloat16 \
    --batch 4 --heads 16 --repeats 5 --no-flex
exit 0
