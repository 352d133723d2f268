"""Per kind (verified or shadow-scored), source and confidence bin: proposals, how often the first
drafted token was accepted, how often a later one was (given the one before it was), and the
per-token rate the gate had estimated at the time."""
import json
import sys
from collections import defaultdict

BINS = (0.0, 0.5, 2 / 3, 0.75, 5 / 6, 0.9, 17 / 18, 33 / 34)  # gate.CONFIDENCE_BINS

agg = defaultdict(lambda: [0, 0, 0, 0, 0, 0.0])
for e in json.load(open(sys.argv[1])):
    b = max(i for i, x in enumerate(BINS) if e["conf"] >= x - 1e-9)
    a = agg[(e["kind"], e["source"], b)]
    d, acc = e["drafted"], e["accepted"]
    a[0] += 1
    a[1] += acc > 0
    a[2] += d
    a[3] += acc
    a[4] += max(min(acc + 1, d) - 1, 0)  # later tokens judged: those accepted after the first, and one rejected
    a[5] += e["est"]
print("| kind | source | bin | proposals | drafted | accepted | first token | later tokens | estimate then |")
print("|---|---|---|---|---|---|---|---|---|")
for (kind, source, b), (n, first, d, acc, later, est) in sorted(agg.items()):
    cont = f"{(acc - first) / later:.2f}" if later else "-"
    print(f"| {kind} | {source} | {b} | {n} | {d} | {acc} | {first / n:.2f} | {cont} | {est / n:.2f} |")
