"""Acceptance by depth of MTP heads on the plain greedy outputs of a prompt file (deterministic:
no gate, no timing). python headcmp.py PROMPTS.jsonl CAP HEAD [HEAD ...]"""
import sys, json
from pathlib import Path
root = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(root / "daemon"), str(root / "protocol")]
from warmspec import blas
blas.reexec_with_openblas([sys.argv[0], *sys.argv[1:]])
import mlx.core as mx, numpy as np
from warmspec import bench
from warmspec.model import load
from warmspec.core import mtp
from warmspec.core.engine import Engine
D = 4
lm = load(None)
prompts_file, cap, heads = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
hs = [mtp.load_mtp(Path(h), lm) for h in heads]
eng = Engine(lm, speculate=False)
acc = np.zeros((len(hs), D)); n = 0
per_case = []
for _, case in bench.read_cases([prompts_file]):
    prompt = bench.chat_ids(lm.tokenizer, case.messages)
    out = bench.decode(eng, prompt, min(cap, case.max_tokens or cap)).tokens
    seq = prompt + out
    _, hid = mtp.forward_hidden(lm.model, mx.array([seq]))
    P = len(prompt)
    row = []
    for k, head in enumerate(hs):
        cache = head.make_cache()
        a = np.zeros(D); m = 0
        # the head's cache from the pair (h_{P-1}, t_P) on: the answer's pairs, as the engine feeds it
        fed = P - 1
        for j in range(P - 1, len(seq) - 1 - D):
            drafts, _, _ = head.draft(hid[:, fed:j + 1], mx.array([seq[fed + 1:j + 2]]), cache, D)
            fed = j + 1
            for d in range(D):
                if drafts[d] != seq[j + 2 + d]:
                    break
                a[d] += 1
            m += 1
        acc[k] += a; row.append((a / max(m, 1)).round(3).tolist())
        if k == 0: n += m
    per_case.append((case.id, row))
    print(case.id, " | ".join(str(r) for r in row), flush=True)
for k, h in enumerate(heads):
    r = acc[k] / n
    print(h, "accepted by depth", r.round(3).tolist(), "expected tokens/pass at depth 4:", round(1 + r.sum(), 3))
