import logging
import sys
from warmspec import blas
blas.reexec_with_openblas(sys.argv)
from warmspec import model as M
from warmspec.core.engine import Engine, Run
from warmspec.core import GenerationStats, SamplingParams
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
lm = M.load(None)
engine = Engine(lm, speculate=True)
tok = lm.tokenizer
for text in ["Write a short essay arguing that cities should invest more in public libraries.",
             "What should I consider before adopting a dog? Give practical advice."]:
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
    st = GenerationStats()
    n = sum(len(x) for x in engine.generate_tokens(prompt, Run(SamplingParams(), 128, st), speculate=True))
    s = engine.plain_steps
    print(n, "tokens; best pipelined:", s.best, "means", {k: round(v, 3) for k, v in s.mean.items()}, "count", s.count, flush=True)
