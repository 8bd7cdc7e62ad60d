#!/usr/bin/env bash
# The one command a lent GPU machine runs (torch and Triton there; no flash-attn, no network):
#
#   bash tests/gpu_device_check.sh          with .whl/ carried beside the checkout
#
# .whl/ (ignored by git) holds flash-attn's sdist, `pip download --no-deps --no-binary :all:
# flash-attn==2.8.3.post2` (FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE lets pip read its metadata on a
# CPU machine), and the gguf wheel, the one package minipaged imports that the machine lacks.
# flash-attn's trimmed build (tests/gpu_device_check.py trim) runs in the background from the
# start; the Triton timings, the engines on Triton and the CUDA tests run meanwhile, so they
# still report if the build fails or the time runs out. Then flash-attn's test, its timings
# beside Triton's, and the engines on it. Every log lands in $OUT (the device tool brings that
# folder back); summary.txt has the lines that matter.
set -u
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
START=$(date +%s)
DEADLINE=${DEADLINE:-450}              # seconds: every step's timeout is cut to end before it
elapsed() { echo $(( $(date +%s) - START )); }
cap() {                                # cap N: N seconds, or what is left before the deadline
    local left=$(( DEADLINE - $(elapsed) ))
    echo $(( left < $1 ? (left > 5 ? left : 5) : $1 ))
}
note() { echo "[$(elapsed) s] $*" | tee -a "$OUT/summary.txt"; }
FA=/tmp/fa/flash_attn-2.8.3.post2
CHECK="python3 tests/gpu_device_check.py ${SMALL:-}"     # SMALL=--small: the CPU dry run
TESTS=${TESTS:-"tests/test_triton_attention.py tests/test_paged_attention.py
                tests/test_online_softmax.py tests/test_paged_generation.py"}

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
    | tee -a "$OUT/summary.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/summary.txt"

mkdir -p /tmp/fa && tar xzf .whl/flash_attn-2.8.3.post2.tar.gz -C /tmp/fa \
    && $CHECK trim $FA > "$OUT/fa-build.log" 2>&1
setsid bash -c "cd $FA && FLASH_ATTN_CUDA_ARCHS=90 MAX_JOBS=12 NVCC_THREADS=2 \
    FLASH_ATTENTION_FORCE_BUILD=TRUE python3 setup.py build_ext --inplace >> $OUT/fa-build.log 2>&1;
    echo \$? > /tmp/fa.rc" < /dev/null &
note "flash-attn build started"

timeout "$(cap 120)" $CHECK bench --batches 1 2>&1 | tee "$OUT/bench-triton.txt"
note "Triton batch-1 timings done (rc ${PIPESTATUS[0]})"
timeout "$(cap 150)" python3 -m pytest -q -rs -p no:cacheprovider $TESTS 2>&1 \
    | tee "$OUT/pytest.txt"
note "pytest $(echo $TESTS): $(tail -1 "$OUT/pytest.txt")"
timeout "$(cap 150)" $CHECK engines --backends triton 2>&1 | tee "$OUT/engines-triton.txt"
note "engines on Triton: $(grep '^engines:' "$OUT/engines-triton.txt")"

while [ ! -f /tmp/fa.rc ] && [ "$(elapsed)" -lt $(( DEADLINE - 150 )) ]; do sleep 3; done
note "flash-attn build rc: $(cat /tmp/fa.rc 2>/dev/null || echo still running), \
$(grep -c '\.o$\|\.o \|nvcc' "$OUT/fa-build.log") compiler lines in its log"
if [ "$(cat /tmp/fa.rc 2>/dev/null)" = 0 ]; then
    export PYTHONPATH=$PYTHONPATH:$FA
    timeout "$(cap 60)" python3 -m pytest -q -rs -p no:cacheprovider tests/test_flash_attn_gpu.py \
        2>&1 | tee "$OUT/pytest-flash.txt"
    note "pytest tests/test_flash_attn_gpu.py: $(tail -1 "$OUT/pytest-flash.txt")"
    timeout "$(cap 150)" $CHECK bench 2>&1 | tee "$OUT/bench.txt"
    note "timings with flash-attn done (rc ${PIPESTATUS[0]})"
    timeout "$(cap 90)" $CHECK engines --backends flash_attn 2>&1 | tee "$OUT/engines-flash.txt"
    note "engines on flash-attn: $(grep '^engines:' "$OUT/engines-flash.txt")"
else
    tail -20 "$OUT/fa-build.log"
fi
note "end"
