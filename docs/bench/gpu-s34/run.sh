#!/bin/sh
# Stop 34 on the lent GPU: own prose, plain and n-gram side by side, with the ledger of 899ff04
# (the pipeline's refill after a drafting step booked to drafting) and, in a later call on the
# same machine, with the code before it (9a55835, carried as s34old/; its head copied in).
# Not run in stop 34: no machine started in time (README.md). Make s34old/ first (untracked,
# not committed): mkdir s34old && git archive 9a55835 daemon protocol | tar -x -C s34old &&
# rm -r s34old/daemon/warmspec/heads   (the tree then fits a call beside .gpu-5).
#   call 5:  STEP=new sh docs/bench/gpu-s34/run.sh    (assembles the staged packages first)
#   call 6:  STEP=old sh docs/bench/gpu-s34/run.sh
#   call 7:  STEP=pub sh docs/bench/gpu-s34/run.sh    (public prose, both)
set -eu
if [ ! -d /tmp/site ]; then
  mkdir -p /tmp/stage && cp -r .gpu-5/* /tmp/stage/ && sh /tmp/stage/assemble.sh /tmp/stage > /tmp/assemble.txt 2>&1
  tail -1 /tmp/assemble.txt
fi
export WARMSPEC_CACHE=/tmp/wcache SHARED=/tmp/stage/bench
[ -d s34old/daemon/warmspec/heads ] || cp -r daemon/warmspec/heads s34old/daemon/warmspec/
case ${STEP:-new} in
  new) BUDGET=${BUDGET:-500} TAG=-new EXTRA="--modes plain,ngram" sh bench/h200.sh ownprose ;;
  old) CODE=$PWD/s34old BUDGET=${BUDGET:-500} TAG=-old EXTRA="--modes plain,ngram" sh bench/h200.sh ownprose ;;
  pub) BUDGET=${BUDGET:-170} TAG=-new EXTRA="--modes plain,ngram" sh bench/h200.sh pubprose
       CODE=$PWD/s34old BUDGET=${BUDGET:-170} TAG=-old EXTRA="--modes plain,ngram" sh bench/h200.sh pubprose ;;
esac
