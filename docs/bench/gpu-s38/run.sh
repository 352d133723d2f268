#!/bin/sh
# Stop 38 on the lent GPU: own and public prose, plain and n-gram side by side, with the request's
# decaying calibration (this tree) and without it (adeb8b3, carried as .gpu-5/old/: git archive
# adeb8b3 daemon protocol, heads removed to fit; this tree's heads are copied in).
# Staging: stage-mlx-cuda.sh's folders re-split into .gpu-1 .. .gpu-5 (at most 40 MB each, so
# that each fits a call beside the 23 MB tree); calls 1-4 copy theirs into /tmp/stage, call 5
# runs this script, which copies .gpu-5 and assembles. Then one call per ORDER:
#   ORDER="new old" sh docs/bench/gpu-s38/run.sh ownprose
#   ORDER="old new" sh docs/bench/gpu-s38/run.sh ownprose
#   ORDER="new old" sh docs/bench/gpu-s38/run.sh pubprose
set -eu
if [ ! -d /tmp/site ]; then
  mkdir -p /tmp/stage && cp -r .gpu-5/* /tmp/stage/ && sh /tmp/stage/assemble.sh /tmp/stage > /tmp/assemble.txt 2>&1
  tail -1 /tmp/assemble.txt
fi
old=/tmp/stage/old
[ -d $old/daemon/warmspec/heads ] || cp -r daemon/warmspec/heads $old/daemon/warmspec/
export WARMSPEC_CACHE=/tmp/wcache SHARED=/tmp/stage/bench
step=${1:-ownprose}

for v in ${ORDER:-new old}; do
  code=$PWD; [ "$v" = old ] && code=$old
  CODE=$code BUDGET=${BUDGET:-280} TAG=-$v EXTRA="--modes plain,ngram" sh bench/h200.sh "$step"
done
