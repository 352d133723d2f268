#!/bin/bash
# sweep2.sh TABLE PREFIX ENV... : vlab.py over several case orders (SEEDS, default 4), one line:
# the mean of their geomeans, each order's slowest case, and how many cases were under 0.97x.
# REFS: the references (refs.py). Two orders run at a time (2 cores).
cd "$(dirname "$0")/../../.."
T=$1; P=$2; shift 2
n=0; out=$(for seed in ${SEEDS:-"" 1 2 3}; do
  env "$@" ORDER_SEED=$seed QUIET=1 PYTHONPATH=daemon:protocol .venv/bin/python docs/bench/lab-s42/vlab.py ${REFS:-/tmp/lab/refs-all.json} $T $P 3 0.015 2>&1 | tail -1 &
  n=$((n+1)); if [ $((n % 2)) = 0 ]; then wait; fi
done; wait)
echo "$out" | python3 -c "
import sys,re
g=[];m=[];u=0
for l in sys.stdin:
    x=re.search(r'geomean ([\d.]+)\s+min ([\d.]+).*under0.97 (\d+)',l)
    g.append(float(x[1]));m.append(float(x[2]));u+=int(x[3])
print('$*'.ljust(50), 'geo %.3f'%(sum(g)/len(g)), 'mins', ' '.join('%.3f'%v for v in m), 'under', u)
"
