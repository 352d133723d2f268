"""Plain greedy outputs (cap 256) of prose sets, cached for replays."""
import sys, json
sys.path[:0] = ["/work/main/daemon", "/work/main/protocol"]
from pathlib import Path
from warmspec import bench as B
from warmspec.model import load
from warmspec.core.engine import Engine, Run
from warmspec.core.types import SamplingParams
out = Path("/tmp/hb/plain.json")
done = json.loads(out.read_text()) if out.exists() else {}
lm = load()
eng = Engine(lm, speculate=False)
for f in ["/work/main/bench/prose-own.jsonl", "/work/shared/bench/prose-public.jsonl"]:
    for file, case in B.read_cases([Path(f)]):
        key = f"{Path(file).name}:{case.id}"
        if key in done: continue
        prep = B.prepare(case, lm.tokenizer, Path(f).parent)
        prompt = prep.turns[-1]
        s = B.decode(eng, prompt, min(256, case.max_tokens or 256))
        done[key] = {"prompt": prompt, "out": s.tokens, "max_tokens": min(256, case.max_tokens or 256)}
        out.write_text(json.dumps(done)); print(key, len(s.tokens), flush=True)
