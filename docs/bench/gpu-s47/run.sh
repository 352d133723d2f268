#!/bin/sh
# Stop 47's measurement calls, after staging as in gpu-s44 (.gpu-1 .. .gpu-5, early.sh and
# model.sh there): sh docs/bench/gpu-s47/run.sh [STEP...]
#   own q4own pub q4pub   as gpu-s45/run.sh: prose, plain and n-gram, --recheck 3
#   edits2     the public edits stop 45 did not reach in float32 (25-40)
#   q4edits2   the same in 4-bit (17-40)
#   optiq      warmspec plain and n-gram against OptiQ 0.7.7 (carry .gpu-optiq), float32 then
#              4-bit, first LIMIT edits (default 12) and the 10 public prose prompts
set -u
export PYTHONPATH=/tmp/site:$PWD/daemon:$PWD/protocol WARMSPEC_CACHE=/tmp/wcache
for step in "$@"; do
  case $step in
    own|q4own|pub|q4pub) sh docs/bench/gpu-s45/run.sh "$step" ;;
    edits2) mkdir -p /tmp/e25 && tail -n +25 /tmp/stage/bench/edits-public.jsonl > /tmp/e25/edits-public.jsonl
            SHARED=/tmp/e25 TAG=-25-40 BUDGET=${BUDGET:-200} sh bench/h200.sh f32edits ;;
    q4edits2) mkdir -p /tmp/e17 && tail -n +17 /tmp/stage/bench/edits-public.jsonl > /tmp/e17/edits-public.jsonl
            SHARED=/tmp/e17 TAG=-17-40 BUDGET=${BUDGET:-200} sh bench/h200.sh q4edits ;;
    optiq) SHARED=/tmp/stage/bench LIMIT=${LIMIT:-12} BUDGET=${BUDGET:-200} sh bench/h200.sh f32optiq q4optiq ;;
  esac
done
