"""One summary per set from the results.json of the calls that measured its parts (a step cut by
its budget was continued in a later call on the cases it had not reached). Per case under the
floor: what drafting kept, and what the engine's ledger booked it to have saved by the clock.

    PYTHONPATH=daemon:protocol python docs/bench/gpu-s47/merge.py > docs/bench/gpu-s47/summary.txt
"""

import statistics
from pathlib import Path

import msgspec

from warmspec.bench import BenchResults, _key, case_speedup, mode_summary, paired_speedup, run_spread

HERE = Path(__file__).parent
SETS = {
    "our 36 prose, float32": ["ownprose", "ownprose-32-36"],
    "our 36 prose, 4-bit": ["q4ownprose", "q4ownprose-14-36"],
    "public prose, float32": ["pubprose"],
    "public prose, 4-bit": ["q4pubprose"],
    "public edits 25-40, float32": ["f32edits-25-40"],
    "public edits 17-40, 4-bit": ["q4edits-17-40"],
}

for name, parts in SETS.items():
    rows = [r for p in parts
            for r in msgspec.json.decode((HERE / p / "results.json").read_bytes(), type=BenchResults).cases]
    plain = {_key(r): r for r in rows if r.mode == "plain"}
    spec = [r for r in rows if r.mode == "ngram"]
    repeat = 3 if "prose" in name else 1
    s = mode_summary(spec, plain, repeat)
    spread = statistics.median(run_spread(r) for r in plain.values())
    print(f"{name}: {s.cases} cases, n-gram {s.speedup_vs_plain:.2f}x plain, slowest {s.min_speedup:.2f}x "
          f"({s.min_case}), paired {s.min_paired_speedup:.2f}x ({s.min_paired_case}), under 0.97x "
          f"{s.below_floor} by medians / {s.below_floor_paired} paired ({s.rechecked} rechecked, "
          f"{s.below_floor_first} paired on their first repeats), {s.tokens_per_pass:.2f} tok/pass, "
          f"identical {s.identical}, plain's repeats spread {spread - 1:.0%} (median case), the ledger "
          f"lost on {s.below_floor_ledger} of those under 0.97x, the loop's plain step "
          f"{s.loop_plain_step:.3f}x plain's (median case)")
    for r in spec:
        p = plain[_key(r)]
        m, pr = case_speedup(r, p), paired_speedup(r, p)
        if min(m, pr) < 0.97 or r.divergence is not None:
            div = (f", differs at {r.divergence.position} (margin {r.divergence.margin:.1e})"
                   if r.divergence is not None else "")
            print(f"  {r.id}: {m:.2f}x medians, {pr:.2f}x paired, {len(r.decode_runs)} runs, "
                  f"{r.accepted}/{r.drafted} kept, {r.passes} passes, ledger {r.booked_s * 1e3:+.0f} ms{div}")
