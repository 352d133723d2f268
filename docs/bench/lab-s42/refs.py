"""Plain greedy answers (token ids) of every case in PROMPTS.jsonl, for ``vlab.py``.

    python3 refs.py REFS.json PROMPTS.jsonl...
"""
import json, sys, tempfile
from pathlib import Path
from warmspec.model import load
from warmspec.core import Engine
from warmspec import bench
lm = load(None, dequantize=True)
eng = Engine(lm, speculate=False)
out = {}
for f in sys.argv[2:]:
    for name, case in bench.read_cases([Path(f)]):
        prep = bench.prepare(case, lm.tokenizer, Path(tempfile.mkdtemp()))
        bench.flush(eng)
        s = bench.decode(eng, prep.turns[-1], case.max_tokens)
        out[f"{name}/{case.id}"] = {"prompt": prep.turns[-1], "ref": s.tokens, "finish": s.finish_reason}
        print(case.id, len(s.tokens), flush=True)
        json.dump(out, open(sys.argv[1], "w"))
