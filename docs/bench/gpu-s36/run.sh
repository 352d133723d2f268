#!/bin/sh
# Stop 36 on the lent GPU: own and public prose, plain and n-gram side by side, with the request's
# calibration of the acceptance estimates (this tree) and without it (cafac89, carried as
# .gpu-6/old/: git archive cafac89 daemon protocol | tar -x -C .gpu-6/old, heads removed to fit;
# this tree's heads are copied in). Staging as bench/h200.sh says; then, one call each:
#   STEP=new sh docs/bench/gpu-s36/run.sh   (assembles the staged packages first)
#   STEP=old sh docs/bench/gpu-s36/run.sh
#   STEP=pub sh docs/bench/gpu-s36/run.sh   (public prose, both)
set -eu
if [ ! -d /tmp/site ]; then
  mkdir -p /tmp/stage && cp -r .gpu-6/* /tmp/stage/ && sh /tmp/stage/assemble.sh /tmp/stage > /tmp/assemble.txt 2>&1
  tail -1 /tmp/assemble.txt
fi
old=/tmp/stage/old
[ -d $old/daemon/warmspec/heads ] || { mkdir -p $old && cp -r .gpu-6/old/* $old/ 2>/dev/null || true; cp -r daemon/warmspec/heads $old/daemon/warmspec/; }
export WARMSPEC_CACHE=/tmp/wcache SHARED=/tmp/stage/bench
case ${STEP:-new} in
  new) BUDGET=${BUDGET:-280} TAG=-new EXTRA="--modes plain,ngram" sh bench/h200.sh ownprose ;;
  old) CODE=$old BUDGET=${BUDGET:-280} TAG=-old EXTRA="--modes plain,ngram" sh bench/h200.sh ownprose ;;
  pub) BUDGET=${BUDGET:-130} TAG=-new EXTRA="--modes plain,ngram" sh bench/h200.sh pubprose
       CODE=$old BUDGET=${BUDGET:-130} TAG=-old EXTRA="--modes plain,ngram" sh bench/h200.sh pubprose ;;
esac
