"""``warmspec forge``: train an MTP head for a model that has none, by self-distillation.

The labels are the target's own predictions (teacher forcing): the target runs over a text, and
for the pair (h_i, t_{i+1}) -- its final-norm hidden state at position i and the text's next token --
the label is the target's distribution at position i+1 (its top-k, renormalised over the head's
draft vocabulary). So the head learns what the target will say, not what a corpus says: on the
target's own greedy text the two agree, elsewhere only the target counts, since a draft is
accepted when it equals the target's choice.

Data, all offline: prose of the installed Python environment (the stdlib's pydoc topics, package
descriptions in ``*.dist-info/METADATA``, Markdown/reST files, docstrings), its source code, and
the target's own greedy answers to a prompt set built here from templates over topics (batched
generation: ~3x the n-gram engine's tokens per second on this 2-core CPU, and the labels are
re-derived by teacher forcing anyway). Each document gives one window of at most ``window``
tokens (a seeded slice of a longer one); a tenth of the documents, chosen by a hash of their
source, is held back to measure the head at the end.

Costs that decide the shape (2-core CPU, OpenBLAS, float32, the default model):
- the target pass over the windows is the expensive part (60-130 tok/s, batched 8 x 256), so it
  runs once and is cached on disk: hidden states (float16) and the target's top-k per position,
  keyed by the target's SHA-256 and the windows' tokens; ``--resume`` and later runs reuse it;
- a head training step over 16 x 128 positions costs ~1/8 of the target pass over them;
- the head scores a reduced draft vocabulary (the ``vocab`` most frequent argmaxes of the target
  on the training windows; ``core/mtp.py`` says why), which also makes its output layer cheap to
  train.

Training: Adam with warm-up and cosine decay; batches are a pure function of (seed, step), so a
run resumed from its checkpoint (weights, optimizer state, step: ``OUT.ckpt.safetensors``) sees
the same batches as one that was not interrupted. The head starts from a copy of the target's
last decoder layer (measured: faster to a given acceptance than a random init). ``--unroll N``
also trains depths 2..N on the head's own state, as it drafts (``unrolled``).

Evaluation on the held-back windows, with the head as stored (float16, loaded back through
``load_mtp``): depth-1 agreement teacher-forced over every position (answers: their answer
positions only, the head's cache starting at the first answer token as in the engine), the draft
vocabulary's coverage, and acceptance by depth 1..4 exactly as greedy verification would judge it:
at sampled positions the head drafts 4 tokens feeding back its own outputs, and one target pass
over them (on the window's KV cache, trimmed back to the position) gives the target's choices.
The same acceptance by depth on the unseen set (``unseen_prompts``: phrasings and topics no
training answer used) is the figure to expect on a user's prompts; ``--check HEAD`` measures
just that.

Nothing here imports MLX at module level: the CLI imports this module before it re-executes
itself on OpenBLAS.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np

if TYPE_CHECKING:
    from .core.mtp import MTPHead
    from .model import LoadedModel

KINDS = ("prose", "code", "answers")
HELD_PERCENT = 10  # documents held back from training, by a hash of their source
MIN_TOKENS = 48  # shorter documents are dropped


def log(msg: str) -> None:
    print(f"forge: {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Config:
    """Everything that decides the head; recorded in its recipe. The defaults are the shipped
    head's recipe (``warmspec forge --out H`` reproduces it).

    Data and steps were what held-back depth-1 agreement needed (H200, float32 target; corpus /
    answers): 512 windows and 900 steps gave 31.5% / 36.6%; 1248 windows, 4000 steps 44.3% /
    41.4%; 2784 windows, 12000 steps 51.9% / 40.5% (6.3 min, 5.3 of them training). More text
    helped more than more steps; the answers plateaued near 40% with 224 of them and a 4096-token
    draft vocabulary that covered 82% of their tokens: 1536 answers and 8192 tokens (95%) gave
    51.5% / 56.2% (8.4 min, 2.2 of them answering). Half as much again of prose and twice the
    answers, with 20000 steps, gave 54.7% / 62.6%, and acceptance by depth on the answers went
    from 54 / 23 / 9 / 4% to 58 / 28 / 15 / 9% (13.7 min, the run resumed once at step 9550).

    ``unroll`` stays 1. With 3 (the same data and steps, H200, 20.5 min against 11.5) the held-back
    answers were accepted by depth 61 / 39 / 26 / 17%. On the outputs of prompts not drawn from
    its templates the later drafts gained and the first did not: our own 24 prose prompts 48 / 24 /
    13 / 7% against 49 / 21 / 9 / 4%, the public 10 49 / 25 / 13 / 6% against 49 / 22 / 9 / 4%
    (1.92 tokens a pass at depth 4 against 1.83-1.84) -- and on a CPU, where drafts are one to
    three tokens, the first draft decides most of the gain."""

    prose: int = 3072       # windows of installed-environment prose
    code: int = 512         # windows of installed-environment source code
    answers: int = 3072     # prompts the target answers (one window each)
    answer_tokens: int = 200
    window: int = 256       # tokens per window (the target's context for its hidden states)
    top_k: int = 8          # the target's top-k kept per position (the soft labels)
    vocab: int = 8192       # draft vocabulary size
    steps: int = 20000
    batch: int = 16         # crops per step
    crop: int = 128         # positions per crop (the head's cache starts at the crop)
    lr: float = 1e-3
    feature_weight: float = 1.0  # the next hidden state's regression, beside the top-k
    warmup: int = 50
    seed: int = 0
    init: str = "last-layer"  # or "random"
    precision: str = "float16"
    unroll: int = 1         # depths trained on the head's own state (1: teacher-forced only)
    eval_positions: int = 192  # positions per held-back set for acceptance by depth
    unseen: int = 48        # prompts of the unseen set (templates and topics not trained on)
    gen_batch: int = 64
    pass_batch: int = 8


@dataclass
class Doc:
    kind: str
    name: str  # its source (a path, a topic, a prompt); the held-back split hashes it
    tokens: list[int]
    start: int = 0  # answers: where the answer begins (the prompt before it is context only)
    held: bool = False


# -- the installed environment's text --------------------------------------------------------------

def python_roots() -> list[Path]:
    """The stdlib and site-packages of the interpreter running warmspec."""
    paths = sysconfig.get_paths()
    roots: list[Path] = []
    for key in ("stdlib", "purelib", "platlib"):
        p = Path(paths[key]).resolve()
        if p.is_dir() and p not in roots:
            roots.append(p)
    return roots


def _walk(roots: Sequence[Path], suffixes: tuple[str, ...]) -> list[Path]:
    """Files under ``roots`` with these suffixes, sorted (deterministic); a root nested in another
    is walked once; the stdlib's own site-packages is skipped (the venv's is a root of its own)."""
    out: set[Path] = set()
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", "site-packages")
                                 or Path(dirpath, d).resolve() in roots)
            out.update(Path(dirpath, f) for f in filenames if f.endswith(suffixes))
    return sorted(out)


def _licence(path: Path) -> bool:
    name = path.name.upper()
    return any(w in name for w in ("LICENSE", "LICENCE", "COPYING", "NOTICE", "AUTHORS", "RECORD"))


def _readable(text: str) -> bool:
    """Mostly words: not a data table, a word list or minified code."""
    letters = sum(c.isalpha() or c == " " for c in text)
    return len(text) >= 400 and letters >= 0.7 * len(text)


def _read(path: Path, limit: int = 200_000) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(limit)
    except OSError:
        return ""


def _docstrings(source: str) -> str:
    """A module's docstrings (module, classes, functions) of 80 characters or more, in order."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 80:
                parts.append(doc)
    return "\n\n".join(parts)


def _metadata_body(text: str) -> str:
    """A package's long description: the METADATA body after its headers."""
    head, sep, body = text.partition("\n\n")
    return body if sep else ""


def prose_sources(roots: Sequence[Path]) -> dict[str, list[tuple[str, Any]]]:
    """Candidate prose documents by source, each a list of (name, loader) sorted by name: loading
    is deferred so that only the documents drawn are read (and parsed, for docstrings)."""
    topics: list[tuple[str, Any]] = []
    try:
        from pydoc_data.topics import topics as pydoc_topics
        topics = [(f"pydoc:{k}", (lambda v=v: v)) for k, v in sorted(pydoc_topics.items())]
    except ImportError:
        pass
    meta = [(str(p), (lambda p=p: _metadata_body(_read(p))))
            for p in _walk(roots, ("METADATA",)) if p.parent.name.endswith(".dist-info")]
    docs = [(str(p), (lambda p=p: _read(p)))
            for p in _walk(roots, (".md", ".rst", ".txt")) if not _licence(p)]
    strings = [(f"docstrings:{p}", (lambda p=p: _docstrings(_read(p))))
               for p in _walk(roots, (".py",))]
    return {"pydoc": topics, "metadata": meta, "docs": docs, "docstrings": strings}


def code_sources(roots: Sequence[Path]) -> list[tuple[str, Any]]:
    return [(str(p), (lambda p=p: _read(p))) for p in _walk(roots, (".py",))
            if 1_000 <= _size(p) <= 200_000]


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def held_back(name: str) -> bool:
    """The split, by document source: a file's docstrings and its code fall on the same side."""
    base = name.split(":", 1)[1] if name.startswith(("docstrings:", "pydoc:")) else name
    return int(hashlib.sha256(base.encode()).hexdigest()[:8], 16) % 100 < HELD_PERCENT


def draw(sources: dict[str, list[tuple[str, Any]]], n: int, kind: str, tokenizer, window: int,
         rng: random.Random, check=_readable) -> list[Doc]:
    """``n`` documents of at least ``MIN_TOKENS`` tokens, taken in turn from each source (shuffled
    by ``rng``) so that no source crowds out the others; each is cut to a seeded slice of
    ``window`` tokens."""
    queues = []
    for name in sorted(sources):
        items = list(sources[name])
        rng.shuffle(items)
        queues.append(items)
    out: list[Doc] = []
    while len(out) < n and any(queues):
        for q in queues:
            while q and len(out) < n:
                name, load = q.pop()
                text = load()
                if not text or not check(text):
                    continue
                ids = tokenizer.encode(text[:window * 16])
                if len(ids) < MIN_TOKENS:
                    continue
                start = rng.randrange(len(ids) - window + 1) if len(ids) > window else 0
                out.append(Doc(kind, name, ids[start:start + window], held=held_back(name)))
                break
    return out


# -- the target's own answers ----------------------------------------------------------------------

TEMPLATES = (
    "Write a short story (about 150 words) about {t}.",
    "Explain {t} to a curious teenager.",
    "Give four practical tips about {t}, one sentence each.",
    "Describe {t} in simple terms for a child.",
    "Write a friendly email to a friend about {t}.",
    "What are the advantages and disadvantages of {t}? Answer in two paragraphs.",
    "Write a short poem about {t}.",
    "Summarize what someone should know about {t} in one paragraph.",
    "Explain {t} using an everyday analogy.",
    "List five interesting facts about {t}.",
    "Write a product description for something related to {t}.",
    "What are common mistakes people make with {t}, and how can they avoid them?",
    "Write the opening paragraph of an essay about {t}.",
    "Answer a beginner's question: how does {t} work?",
    "Write a dialogue between two people discussing {t}.",
    "Give a step-by-step guide for getting started with {t}.",
    "Write a short persuasive essay about {t}.",
    "Write a letter to a local newspaper about {t}.",
    "Give practical advice to a beginner interested in {t}.",
    "List six questions people often ask about {t}, and answer each briefly.",
    "Explain why {t} matters, in three short paragraphs.",
    "Write a diary entry from someone experiencing {t} for the first time.",
    "Compare two different approaches to {t}.",
    "Write a short speech for a school assembly about {t}.",
)
TOPICS = (
    "learning to play the guitar", "a rainy day in a big city", "recursion in programming",
    "the history of the printing press", "growing tomatoes on a balcony", "black holes",
    "saving money on groceries", "a dragon who is afraid of fire", "version control with git",
    "the human immune system", "training for a first marathon", "a robot learning to paint",
    "time zones", "composting at home", "the French Revolution", "unit testing",
    "how airplanes fly", "a lost dog finding its way home", "public speaking", "photosynthesis",
    "writing a resume", "the moon landing", "sorting algorithms", "baking sourdough bread",
    "a friendship between a fox and an owl", "climate and weather", "learning a second language",
    "electric cars", "the Roman Empire", "a treasure map found in an attic", "password security",
    "meditation", "volcanoes", "running a small bakery", "regular expressions", "bees and pollination",
    "a journey on a night train", "the stock market", "camping in the mountains", "JSON files",
    "the invention of the telephone", "keeping a journal", "ocean tides", "a city on Mars",
    "caching in web applications", "chess openings", "recycling plastic", "a wizard's apprentice",
    "the solar system", "cooking rice perfectly", "databases and SQL", "the Renaissance",
    "a haunted library", "exercise and sleep", "how the internet works", "knitting a scarf",
    "earthquakes", "a detective solving a small mystery", "functional programming",
    "the life of an ant colony", "planning a birthday party", "rainbows", "an old clockmaker",
    "working from home", "the Great Wall of China", "debugging a program", "birdwatching",
    "a bakery that only opens at midnight", "learning to swim as an adult", "glaciers",
    "the history of coffee", "recycling electronics", "a village without electricity",
    "writing a novel", "deep sea creatures", "moving to a new country", "the Silk Road",
    "bicycle repair", "the water supply of a city", "a king who could not sleep", "jazz music",
    "choosing a first computer", "tidying a cluttered room", "penguins", "the metric system",
    "a spaceship crew stuck in orbit", "online privacy", "teaching children to read",
    "the history of chocolate", "wind power", "a street musician", "rivers and floods",
    "making friends in a new city", "the Olympic Games", "a talking tree", "mushrooms in the forest",
    "budgeting for a holiday", "the printing of money", "lighthouses", "learning to draw",
    "a small island community", "the life of a honeybee queen", "typing faster",
    "the first day at a new school", "ancient Egypt", "trains and railways", "houseplants",
    "a robot that wants to be a chef", "the speed of light", "volunteering", "an abandoned castle",
    "a farmers market", "the history of writing", "autumn leaves", "a lost umbrella",
    "solar panels on a roof", "cats and their habits", "a museum at night", "the human heart",
    "spreadsheets", "a long-distance friendship", "wolves", "a shipwreck", "learning math",
    "board games", "a snowstorm", "the invention of the wheel", "street food", "kindness",
)


def prompts(n: int, seed: int) -> list[str]:
    """``n`` distinct prompts, templates over topics, drawn by ``seed`` (none of them the bench's)."""
    pairs = [(t, s) for t in TEMPLATES for s in TOPICS]
    random.Random(seed).shuffle(pairs)
    return [t.format(t=s) for t, s in pairs[:n]]


# The unseen set: phrasings and topics that appear nowhere in TEMPLATES / TOPICS (nor in the
# bench's prompt files). The held-back answers share their templates and topics with the
# training answers (only the pairs differ), and overstate what a user's prompts get: the shipped
# head's first draft was right 58% of the time there and 49% on the outputs of our own 24 prose
# prompts and the public 10 (docs/bench/cpu-s30).
UNSEEN_TEMPLATES = (
    "I'm preparing a short talk on {t}. Which points should I cover?",
    "Could you tell a short story in which {t} plays a part?",
    "My friend doesn't understand {t}. How would you explain it to them?",
    "Draft an email to a colleague about {t}.",
    "What would a typical day look like for someone whose work involves {t}?",
    "Write a brief report on {t} for a club newsletter.",
    "What are three myths about {t}, and what is actually true?",
    "Give me a short history of {t}.",
)
UNSEEN_TOPICS = (
    "public fountains", "paper airplanes", "the history of maps", "tea ceremonies",
    "sailing a small boat", "fixing a leaky tap", "learning to juggle", "flying a kite",
    "vintage typewriters", "a school science fair", "night skies in the desert", "origami",
)


def unseen_prompts(n: int) -> list[str]:
    """``n`` (at most 96) distinct prompts of the unseen set: prompt k pairs template k mod 8 with
    topic (k + k // 24) mod 12, so every template and topic comes round in turn."""
    T, S = UNSEEN_TEMPLATES, UNSEEN_TOPICS
    n = min(n, len(T) * len(S))
    return [T[k % len(T)].format(t=S[(k + k // 24) % len(S)]) for k in range(n)]


def generate_answers(lm: "LoadedModel", texts: Sequence[str], max_tokens: int, batch: int,
                     path: Path) -> list[tuple[str, list[int], list[int]]]:
    """(prompt, prompt ids, greedy answer ids) for every prompt, appended to ``path`` (JSON lines)
    as they finish, so an interrupted run answers only the rest."""
    from mlx_lm.generate import BatchGenerator

    tok = lm.tokenizer
    done: dict[str, tuple[list[int], list[int]]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by an interruption
            done[r["prompt"]] = (r["prompt_ids"], r["answer"])
    todo = [t for t in texts if t not in done]
    if todo:
        log(f"answers: {len(done)} cached, generating {len(todo)} (greedy, up to {max_tokens} tokens, "
            f"batches of {batch})")
    t0 = time.perf_counter()
    made = 0
    with open(path, "a") as out:
        for i in range(0, len(todo), batch):
            chunk = todo[i:i + batch]
            ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in chunk]
            stops = [[e] for e in sorted(tok.eos_ids)] or None
            gen = BatchGenerator(lm.model, max_tokens=max_tokens, stop_tokens=stops,
                                 completion_batch_size=batch, prefill_batch_size=batch)
            uids = gen.insert(ids)
            answers: dict[int, list[int]] = {u: [] for u in uids}
            while responses := gen.next_generated():
                for r in responses:
                    if r.finish_reason != "stop":
                        answers[r.uid].append(int(r.token))
            gen.close()
            for t, p, u in zip(chunk, ids, uids):
                done[t] = (p, answers[u])
                made += len(answers[u])
                out.write(json.dumps({"prompt": t, "prompt_ids": p, "answer": answers[u]}) + "\n")
            out.flush()
            rate = made / (time.perf_counter() - t0)
            log(f"answers: {min(i + batch, len(todo))}/{len(todo)}, {made} tokens, {rate:.1f} tok/s")
    return [(t, *done[t]) for t in texts]


# -- documents -------------------------------------------------------------------------------------

def collect(lm: "LoadedModel", cfg: Config, cache: Path, target_sha: str, *,
            texts: Sequence[tuple[str, str, str]] | None = None) -> list[Doc]:
    """The documents: drawn from the installed environment and the target's answers, or, with
    ``texts`` ((kind, name, text) triples, for tests and custom corpora), those texts instead (the
    "answers" kind then means: this text is a prompt to answer)."""
    tok = lm.tokenizer
    docs: list[Doc] = []
    if texts is not None:
        for kind, name, text in texts:
            if kind != "answers":
                ids = tok.encode(text)[:cfg.window]
                docs.append(Doc(kind, name, ids, held=held_back(name)))
        asks = [text for kind, _, text in texts if kind == "answers"]
    else:
        roots = python_roots()
        log(f"corpus: {', '.join(map(str, roots))}")
        # one stream per kind: a run drawing more of one kind draws the same documents first
        docs += draw(prose_sources(roots), cfg.prose, "prose", tok, cfg.window,
                     random.Random(f"{cfg.seed}:prose"))
        docs += draw({"code": code_sources(roots)}, cfg.code, "code", tok, cfg.window,
                     random.Random(f"{cfg.seed}:code"), check=lambda s: len(s) >= 400)
        asks = prompts(cfg.answers, cfg.seed)
    if asks:
        docs += answer_docs(lm, asks, cfg, cache / f"answers-{_key(target_sha, cfg.answer_tokens)}.jsonl",
                            "prompt")
    return docs


def answer_docs(lm: "LoadedModel", asks: Sequence[str], cfg: Config, path: Path, prefix: str,
                held: bool | None = None) -> list[Doc]:
    """The target's answers to ``asks`` (cached in ``path``) as documents named ``prefix:prompt``,
    the prompt as context; held back by the name's hash unless ``held`` says."""
    docs = []
    for prompt, p_ids, a_ids in generate_answers(lm, asks, cfg.answer_tokens, cfg.gen_batch, path):
        ids = (p_ids + a_ids)[:cfg.window]
        if len(ids) > len(p_ids) + 1:
            name = f"{prefix}:{prompt}"
            docs.append(Doc("answers", name, ids, start=len(p_ids),
                            held=held_back(name) if held is None else held))
    return docs


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


# -- the target pass, cached -----------------------------------------------------------------------

@dataclass
class Windows:
    """Every window's target pass: ``hidden`` (n, L, D) float16, ``top_ids`` / ``top_logp``
    (n, L, K) -- the target's top-k at each position --, ``tokens`` (n, L) and ``length`` (n,)."""

    docs: list[Doc]
    tokens: np.ndarray
    length: np.ndarray
    hidden: np.ndarray
    top_ids: np.ndarray
    top_logp: np.ndarray

    def index(self, kind: str | None = None, held: bool | None = None) -> np.ndarray:
        return np.array([i for i, d in enumerate(self.docs)
                         if (kind is None or d.kind == kind) and (held is None or d.held == held)], dtype=np.int64)


def target_pass(lm: "LoadedModel", docs: list[Doc], cfg: Config, cache: Path, target_sha: str) -> Windows:
    """Run the target over every window in batches (longest first, right-padded: causal attention
    keeps the padding out of the real positions) and keep what the head trains on. Each window's
    result is a file under ``cache/pass-TARGET/``, named by a hash of its tokens, so any run over
    the same target reuses the windows it shares with earlier ones."""
    import mlx.core as mx

    from .core.mtp import forward_hidden

    L, K = cfg.window, cfg.top_k
    n = len(docs)
    tokens = np.zeros((n, L), dtype=np.int32)
    length = np.array([len(d.tokens) for d in docs], dtype=np.int32)
    for i, d in enumerate(docs):
        tokens[i, :len(d.tokens)] = d.tokens
    folder = cache / f"pass-{_key(target_sha, K)}"
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{_key(d.tokens)}.npz" for d in docs]
    todo = [i for i in np.argsort(-length, kind="stable").tolist() if not paths[i].exists()]
    if len(todo) < n:
        log(f"target pass: {n - len(todo)} of {n} windows cached in {folder}")
    t0 = time.perf_counter()
    done = 0
    left = int(length[todo].sum())
    for b in range(0, len(todo), cfg.pass_batch):
        rows = todo[b:b + cfg.pass_batch]
        width = int(length[rows].max())
        logits, h = forward_hidden(lm.model, mx.array(tokens[rows, :width]))
        logits = logits.astype(mx.float32)
        ids = mx.argpartition(-logits, K - 1, axis=-1)[..., :K]
        vals = mx.take_along_axis(logits, ids, axis=-1)
        order = mx.argsort(-vals, axis=-1)
        ids = mx.take_along_axis(ids, order, axis=-1)
        logp = mx.take_along_axis(vals, order, axis=-1) - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(h, ids, logp)
        h, ids, logp = np.array(h.astype(mx.float16)), np.array(ids.astype(mx.int32)), np.array(logp.astype(mx.float16))
        for r, i in enumerate(rows):
            m = int(length[i])
            tmp = paths[i].with_suffix(".tmp.npz")
            np.savez(tmp, hidden=h[r, :m], top_ids=ids[r, :m], top_logp=logp[r, :m])
            os.replace(tmp, paths[i])
        done += int(length[rows].sum())
        rate = done / (time.perf_counter() - t0)
        log(f"target pass: {min(b + cfg.pass_batch, len(todo))}/{len(todo)} windows, {done} tokens, "
            f"{rate:.0f} tok/s, ~{(left - done) / max(rate, 1e-9) / 60:.1f} min left")
    hidden = top_ids = top_logp = None
    for i, path in enumerate(paths):
        part = np.load(path)
        if hidden is None:
            hidden = np.zeros((n, L, part["hidden"].shape[-1]), dtype=np.float16)
            top_ids = np.zeros((n, L, K), dtype=np.int32)
            top_logp = np.full((n, L, K), -np.inf, dtype=np.float16)
        m = int(length[i])
        hidden[i, :m], top_ids[i, :m], top_logp[i, :m] = part["hidden"], part["top_ids"], part["top_logp"]
    return Windows(docs, tokens, length, hidden, top_ids, top_logp)


# -- the draft vocabulary --------------------------------------------------------------------------

def label_mask(win: Windows, rows: np.ndarray) -> np.ndarray:
    """(len(rows), L) True where position p holds a label some pair (h_{p-1}, t_p) is trained or
    judged on: 1 <= p < length, and for answers p >= start (the answer's own positions)."""
    L = win.tokens.shape[1]
    pos = np.arange(L)[None]
    lo = np.array([max(1, win.docs[i].start) for i in rows])[:, None]
    return (pos >= lo) & (pos < win.length[rows][:, None])


def choose_vocab(win: Windows, size: int, vocab_size: int) -> np.ndarray:
    """The ``size`` token ids the target chose most often on the training windows (ties: lower
    id), sorted by id."""
    rows = win.index(held=False)
    chosen = win.top_ids[rows, :, 0][label_mask(win, rows)]
    counts = np.bincount(chosen, minlength=vocab_size)
    top = np.lexsort((np.arange(vocab_size), -counts))[:min(size, vocab_size)]
    return np.sort(top).astype(np.int32)


def coverage(win: Windows, rows: np.ndarray, vocab: np.ndarray) -> float:
    chosen = win.top_ids[rows, :, 0][label_mask(win, rows)]
    return float(np.isin(chosen, vocab).mean()) if chosen.size else 0.0


# -- training --------------------------------------------------------------------------------------

def new_head(lm: "LoadedModel", vocab: np.ndarray, init: str, seed: int) -> "MTPHead":
    """A head over ``vocab``. ``last-layer``: its decoder layer starts as the target's last layer
    of its kind, ``fc`` as the mean of both halves and its norm as the target's final norm -- a
    start that already scores like the target's top layer; ``random``: MLX's init. (MLX arrays
    are values: training replaces the head's, the target's own layer never moves.)"""
    import mlx.core as mx

    from .core.mtp import MTPHead, target_parts

    mx.random.seed(seed)
    parts = target_parts(lm.model)
    head = MTPHead(parts, draft_vocab=vocab)
    if init == "last-layer":
        eye = mx.eye(parts.hidden_size)
        head.fc.weight = mx.concatenate([eye, eye], axis=1) * 0.5
        head.layers[0].update(parts.inner.layers[parts.template].parameters())
        head.norm.weight = parts.norm.weight
    elif init != "random":
        raise ValueError(f"init must be 'last-layer' or 'random', not {init!r}")
    head.set_dtype(mx.float32)
    mx.eval(head.parameters())
    head.ready()
    return head


def batch_at(win: Windows, rows: np.ndarray, vocab_index: np.ndarray, cfg: Config, step: int
             ) -> tuple[np.ndarray, ...]:
    """Step ``step``'s batch, a pure function of (seed, step): ``batch`` training windows, a crop
    of ``crop`` pairs from each at a random offset. Returns hidden (B, C, D), next tokens (B, C),
    labels as draft-vocabulary columns (B, C, K) with their weights (B, C, K; the top-k
    renormalised over the columns present, zero for ids outside the draft vocabulary and padding),
    the target's hidden state at the next position (B, C, D: what the head's output should be) and
    where a pair is labelled at all (B, C)."""
    rng = np.random.default_rng([cfg.seed, step])
    pick = rows[rng.choice(len(rows), size=min(cfg.batch, len(rows)), replace=False)]
    C, K = cfg.crop, cfg.top_k
    B = len(pick)
    hid = np.zeros((B, C, win.hidden.shape[-1]), dtype=np.float32)
    nxt = np.zeros((B, C), dtype=np.int32)
    cols = np.zeros((B, C, K), dtype=np.int32)
    wts = np.zeros((B, C, K), dtype=np.float32)
    ahead = np.zeros((B, C, win.hidden.shape[-1]), dtype=np.float32)
    valid = np.zeros((B, C), dtype=np.float32)
    for b, i in enumerate(pick):
        pairs = int(win.length[i]) - 1  # pairs (h_j, t_{j+1}), j < length - 1
        lo = max(0, win.docs[i].start - 1)
        if pairs - lo > C:
            lo = int(rng.integers(lo, pairs - C + 1))
        hi = min(pairs, lo + C)
        m = hi - lo
        hid[b, :m] = win.hidden[i, lo:hi]
        nxt[b, :m] = win.tokens[i, lo + 1:hi + 1]
        ids = win.top_ids[i, lo + 1:hi + 1]
        c = vocab_index[ids]
        p = np.exp(win.top_logp[i, lo + 1:hi + 1].astype(np.float32)) * (c >= 0)
        total = p.sum(-1, keepdims=True)
        p = np.where(total > 0, p / np.maximum(total, 1e-12), 0.0)
        context = max(0, win.docs[i].start - 1 - lo)  # answers: the prompt is context, not labels
        p[:context] = 0.0
        cols[b, :m] = np.maximum(c, 0)
        wts[b, :m] = p
        ahead[b, :m] = win.hidden[i, lo + 1:hi + 1]
        valid[b, context:m] = 1.0
    return hid, nxt, cols, wts, ahead, valid


def _schedule(cfg: Config):
    import mlx.optimizers as optim

    warm = max(1, min(cfg.warmup, cfg.steps // 4))
    return optim.join_schedules([optim.linear_schedule(cfg.lr * 0.01, cfg.lr, warm),
                                 optim.cosine_decay(cfg.lr, max(1, cfg.steps - warm), cfg.lr * 0.1)],
                                [warm])


CHECKPOINT_EVERY = 50  # steps
DEPTH_WEIGHT = 0.8  # depth d's loss counts DEPTH_WEIGHT ** (d - 1) (EAGLE-3's training-time test)


def unrolled(head: "MTPHead", hidden: "mx.array", tokens: "mx.array", depths: int) -> list[tuple["mx.array", "mx.array"]]:
    """The head at depths 1..``depths`` over a crop at once, as the engine drafts: depth 1 is the
    teacher-forced pass over the pairs (h_j, t_{j+1}); depth d > 1 feeds depth d-1's state at j with
    the token t_{j+d}, at RoPE position j+d-1, attending to the teacher-forced pairs 0..j and to its
    own earlier depths at j -- exactly what the head's cache holds when it drafts its d-th token
    after pair j. Returns (logits, state) per depth; depth d covers pairs 0..C-d.

    Why: trained on depth 1 alone, the shipped head's later drafts were right far less often than
    its first (held-back answers: 58% of drafts accepted at depth 1, 28% through depth 2, 15%
    through 3), because depth 2 conditions on the head's own state, which training never showed it.
    Only llama-style layers (q/k/v/o projections, an optional q/k norm, RoPE, one MLP) are supported."""
    import mlx.core as mx

    layer = head.layers[0]
    attn = getattr(layer, "self_attn", None)
    if attn is None or not all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "rope",
                                                          "n_heads", "n_kv_heads", "scale")):
        raise ValueError(f"forge --unroll > 1 needs a llama-style decoder layer; "
                         f"{type(layer).__module__}.{type(layer).__name__} is not one")
    B, C, _ = hidden.shape
    keys: list[mx.array] = []
    values: list[mx.array] = []
    out = []
    state = hidden
    for d in range(depths):
        L = C - d
        if L <= 0:
            break
        x = head.fuse(state[:, :L], tokens[:, d:])
        n = layer.input_layernorm(x)
        q = attn.q_proj(n).reshape(B, L, attn.n_heads, -1)
        k = attn.k_proj(n).reshape(B, L, attn.n_kv_heads, -1)
        v = attn.v_proj(n).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = attn.rope(q.transpose(0, 2, 1, 3), offset=d)
        k = attn.rope(k.transpose(0, 2, 1, 3), offset=d)
        keys.append(k)
        values.append(v)
        # query j sees depth 1's keys 0..j, then its own column j at depths 2..d+1
        pos = mx.arange(L)
        blocks = [pos[:, None] >= mx.arange(C)[None]] + [pos[:, None] == pos[None]] * d
        mask = mx.concatenate(blocks, axis=1)
        ks = mx.concatenate([keys[0]] + [kk[:, :, :L] for kk in keys[1:]], axis=2)
        vs = mx.concatenate([values[0]] + [vv[:, :, :L] for vv in values[1:]], axis=2)
        a = mx.fast.scaled_dot_product_attention(q, ks, vs, scale=attn.scale, mask=mask)
        h = x + attn.o_proj(a.transpose(0, 2, 1, 3).reshape(B, L, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits, state = head.finish(h)
        out.append((logits, state))
    return out


def train(head: "MTPHead", win: Windows, cfg: Config, ckpt: Path, *, resume: bool) -> dict[str, Any]:
    """Adam over ``cfg.steps`` steps of soft cross-entropy against the target's top-k (at each of
    ``cfg.unroll`` depths, see ``unrolled``); a checkpoint (weights, optimizer state, step) every
    ``CHECKPOINT_EVERY`` steps and at the end; ``resume`` continues from it. Each step is queued
    without waiting for the one before (the next batch is cut on the host meanwhile): on the H200
    a step of the shipped recipe's took 0.02-0.03 s, most of it the host's."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten, tree_unflatten

    vocab_index = np.full(head.parts.vocab_size, -1, dtype=np.int32)
    vocab_index[head.draft_vocab] = np.arange(head.draft_vocab.size)
    rows = win.index(held=False)
    opt = optim.Adam(learning_rate=_schedule(cfg))
    step = 0
    spent_before = 0.0  # training seconds of the runs this one resumes
    meta_path = ckpt.with_suffix(".json")
    if resume and ckpt.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("config") != asdict(cfg):
            raise ValueError(f"{ckpt}: the checkpoint was made with other settings; drop --resume "
                             "or give the same ones")
        saved = mx.load(str(ckpt))
        head.update(tree_unflatten([(k[2:], v) for k, v in saved.items() if k.startswith("w.")]))
        opt.init(head.trainable_parameters())
        opt.state = tree_unflatten([(k[2:], v) for k, v in saved.items() if k.startswith("o.")])
        step = int(meta["step"])
        spent_before = float(meta.get("train_s", 0.0))
        log(f"train: resumed at step {step} from {ckpt}")
    elif resume:
        log(f"train: no checkpoint at {ckpt}; starting at step 0")

    def depth_loss(logits, g, cols, wts, ahead, valid):
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        ce = -(mx.take_along_axis(logp, cols, axis=-1) * wts).sum(-1)
        counted = (wts.sum(-1) > 0).astype(mx.float32)
        loss = ce.sum() / mx.maximum(counted.sum(), 1.0)
        if cfg.feature_weight:
            # the target's next hidden state, relative squared error (EAGLE's feature loss): a
            # 576-number target per position where the top-k gives 8, and the state depth 2 feeds on
            err = ((g - ahead) ** 2).mean(-1) / mx.maximum((ahead ** 2).mean(-1), 1e-6)
            loss = loss + cfg.feature_weight * (err * valid).sum() / mx.maximum(valid.sum(), 1.0)
        return loss

    def loss_fn(model, h, t, cols, wts, ahead, valid):
        if cfg.unroll <= 1:
            logits, g = model(h, t)
            return depth_loss(logits, g, cols, wts, ahead, valid)
        loss = 0.0
        for d, (logits, g) in enumerate(unrolled(model, h, t, cfg.unroll)):
            loss = loss + DEPTH_WEIGHT ** d * depth_loss(logits, g, cols[:, d:], wts[:, d:], ahead[:, d:],
                                                         valid[:, d:])
        return loss

    grad_fn = nn.value_and_grad(head, loss_fn)
    t0 = time.perf_counter()
    losses: list[float] = []
    queued: list[Any] = []
    first = step
    while step < cfg.steps:
        loss, grads = grad_fn(head, *map(mx.array, batch_at(win, rows, vocab_index, cfg, step)))
        opt.update(head, grads)
        mx.async_eval(head.parameters(), opt.state, loss)
        queued.append(loss)
        step += 1
        if step % CHECKPOINT_EVERY == 0 or step == cfg.steps:
            mx.eval(head.parameters(), opt.state, *queued)
            losses.extend(q.item() for q in queued)
            queued.clear()
            spent = time.perf_counter() - t0
            log(f"train: step {step}/{cfg.steps}, loss {np.mean(losses[-50:]):.3f}, "
                f"{spent / (step - first):.3f} s/step, ~{(cfg.steps - step) * spent / (step - first) / 60:.1f} min left")
            tensors = {f"w.{k}": v for k, v in tree_flatten(head.parameters())}
            tensors.update({f"o.{k}": v for k, v in tree_flatten(opt.state)})
            tmp = ckpt.with_name(ckpt.stem + ".tmp.safetensors")
            mx.save_safetensors(str(tmp), tensors)
            os.replace(tmp, ckpt)
            meta_path.write_text(json.dumps({"step": step, "config": asdict(cfg),
                                             "train_s": round(spent_before + spent, 1)}))
    return {"final_loss": float(np.mean(losses[-50:])) if losses else None,
            "resumed_from_step": first or None,
            "train_s": round(spent_before + time.perf_counter() - t0, 1)}


# -- evaluation ------------------------------------------------------------------------------------

DEPTHS = 4


def evaluate(head: "MTPHead", lm: "LoadedModel", win: Windows, rows: np.ndarray, positions: int,
             seed: int) -> dict[str, Any]:
    """On held-back windows ``rows``: teacher-forced depth-1 agreement over every labelled
    position, and acceptance by depth at up to ``positions`` sampled positions (the target's own
    greedy verification of the head's 4-token drafts)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    hits = total = 0
    chains: list[tuple[int, int, list[int]]] = []  # (window, pair j, drafts)
    rng = np.random.default_rng(seed)
    labelled = label_mask(win, rows)
    per_window = max(1, math.ceil(positions / max(1, len(rows))))
    for r, i in enumerate(rows):
        n = int(win.length[i])
        lo = max(0, win.docs[i].start - 1)
        if n - 1 <= lo:
            continue
        h = mx.array(win.hidden[i, lo:n - 1].astype(np.float32))[None]
        t = mx.array(win.tokens[i, lo + 1:n])[None]
        logits, _ = head(h, t)
        got = head.draft_vocab[np.array(mx.argmax(logits[0], axis=-1))]
        want = win.top_ids[i, lo + 1:n, 0]
        m = labelled[r, lo + 1:n]
        hits += int((got == want)[m].sum())
        total += int(m.sum())
        # depth chains at sampled pairs j: the head's cache holds the pairs lo..j, as in the engine
        js = np.sort(rng.choice(np.arange(lo, n - 1), size=min(per_window, n - 1 - lo), replace=False))
        cache = head.make_cache()
        fed = lo
        for j in js.tolist():
            drafts, _, _ = head.draft(h[:, fed - lo:j + 1 - lo], t[:, fed - lo:j + 1 - lo], cache, DEPTHS)
            fed = j + 1
            chains.append((int(i), j, drafts))
    chains = chains[:positions] if len(chains) > positions else chains
    accepted = np.zeros(DEPTHS, dtype=np.int64)
    by_window: dict[int, list[tuple[int, list[int]]]] = {}
    for i, j, d in chains:
        by_window.setdefault(i, []).append((j, d))
    for i, items in by_window.items():
        cache = make_prompt_cache(lm.model)
        last = max(j for j, _ in items)
        lm.model(mx.array(win.tokens[i, :last + 1])[None], cache=cache)
        at = last + 1
        for j, d in sorted(items, reverse=True):  # later positions first: trimming keeps 0..j intact
            trim_prompt_cache(cache, at - (j + 1))
            logits = lm.model(mx.array([[int(win.tokens[i, j + 1]), *d[:-1]]]), cache=cache)
            at = j + 1 + DEPTHS
            choice = np.array(mx.argmax(logits[0], axis=-1)).tolist()
            for k in range(DEPTHS):
                if d[k] != choice[k]:
                    break
                accepted[k] += 1
    n = len(chains)
    return {"depth1_teacher_forced": hits / total if total else None, "positions": total,
            "accepted_by_depth": [float(a / n) for a in accepted] if n else [],
            "depth_positions": n}


EVALUATION_ONLY = ("eval_positions", "unseen")  # Config fields that decide no weights


def evaluate_unseen(head: "MTPHead", lm: "LoadedModel", cfg: Config, cache: Path, target_sha: str
                    ) -> dict[str, Any] | None:
    """Acceptance by depth on the target's answers to the unseen set (``unseen_prompts``): no
    template or topic of it was trained on, so this is the number to expect on a user's prompts.
    Its answers and target pass are cached as the training data's are."""
    asks = unseen_prompts(cfg.unseen)
    if not asks:
        return None
    docs = answer_docs(lm, asks, cfg, cache / f"unseen-{_key(target_sha, cfg.answer_tokens)}.jsonl",
                       "unseen", held=True)
    if not docs:
        return None
    win = target_pass(lm, docs, cfg, cache, target_sha)
    return evaluate(head, lm, win, win.index(), cfg.eval_positions, cfg.seed)


def check(lm: "LoadedModel", head_path: Path, cfg: Config, *, cache: Path | None = None) -> dict[str, Any]:
    """``warmspec forge --check HEAD``: a head's acceptance by depth on the unseen set, without
    training anything (the target answers ``cfg.unseen`` prompts: minutes on a CPU)."""
    from .core.mtp import load_mtp, target_identity

    cache = _cache_dir(cache)
    head = load_mtp(Path(head_path), lm)
    e = evaluate_unseen(head, lm, cfg, cache, target_identity(lm)["sha256"])
    if e is not None:
        _log_eval("unseen", e)
    return {"unseen": e}


def _cache_dir(cache: Path | None) -> Path:
    """Where answers and target passes are kept: ``cache``, else forge/ in the warmspec cache."""
    from . import fetch

    cache = Path(cache) if cache is not None else fetch.cache_dir() / "forge"
    cache.mkdir(parents=True, exist_ok=True)
    return cache


def _log_eval(name: str, e: dict[str, Any]) -> None:
    log(f"held back, {name}: depth-1 agreement {e['depth1_teacher_forced']:.1%} over "
        f"{e['positions']} positions; accepted by depth "
        + " / ".join(f"{a:.1%}" for a in e["accepted_by_depth"]) + f" ({e['depth_positions']} drafts)")


# -- the whole run ---------------------------------------------------------------------------------

def forge(lm: "LoadedModel", out: Path, cfg: Config, *, cache: Path | None = None, resume: bool = False,
          texts: Sequence[tuple[str, str, str]] | None = None, command: str | None = None) -> dict[str, Any]:
    """Collect, pass, train, save (``cfg.precision``), evaluate the saved head; returns its recipe."""
    import mlx.core as mx

    from . import bench
    from .core.mtp import load_mtp, save_mtp, target_identity

    t_start = time.perf_counter()
    out = Path(out)
    if out.suffix != ".safetensors":
        raise ValueError(f"{out}: the head file must end in .safetensors")
    out.parent.mkdir(parents=True, exist_ok=True)
    cache = _cache_dir(cache)
    wall: dict[str, float] = {}
    identity = target_identity(lm)
    log(f"target {identity['name']} ({identity['file']}, sha256 {identity['sha256'][:12]}…), "
        f"{mx.default_device()}")

    t = time.perf_counter()
    docs = collect(lm, cfg, cache, identity["sha256"], texts=texts)
    wall["collect_and_answers"] = time.perf_counter() - t
    for kind in KINDS:
        ks = [d for d in docs if d.kind == kind]
        if ks:
            log(f"data: {kind} {len(ks)} windows, {sum(len(d.tokens) for d in ks)} tokens "
                f"({sum(d.held for d in ks)} held back)")
    if not any(not d.held for d in docs) or not any(d.held for d in docs):
        raise ValueError("forge needs documents on both sides of the held-back split; give more data")

    t = time.perf_counter()
    win = target_pass(lm, docs, cfg, cache, identity["sha256"])
    wall["target_pass"] = time.perf_counter() - t

    parts_vocab = identity["vocab_size"]
    vocab = choose_vocab(win, cfg.vocab, parts_vocab)
    head = new_head(lm, vocab, cfg.init, cfg.seed)
    t = time.perf_counter()
    trained = train(head, win, cfg, out.with_name(out.stem + ".ckpt.safetensors"), resume=resume)
    wall["train"] = time.perf_counter() - t

    data: dict[str, Any] = {"window": cfg.window, "top_k": cfg.top_k, "held_back_percent": HELD_PERCENT,
                            "sources": [str(r) for r in python_roots()] if texts is None else "given texts",
                            "python": sys.version.split()[0]}
    for kind in KINDS:
        ks = [d for d in docs if d.kind == kind]
        data[kind] = {"windows": len(ks), "tokens": sum(len(d.tokens) for d in ks),
                      "held_back_windows": sum(d.held for d in ks),
                      "held_back_tokens": sum(len(d.tokens) for d in ks if d.held)}
    dtype = getattr(mx, cfg.precision)
    recipe: dict[str, Any] = {"target": identity, "data": data, "training": {
        **{k: v for k, v in asdict(cfg).items() if k not in EVALUATION_ONLY}, **trained}}
    save_mtp(head, out, dtype=dtype, **recipe)  # saved first: the evaluation reads it back

    t = time.perf_counter()
    stored = load_mtp(out, lm)
    evaluation: dict[str, Any] = {"precision": cfg.precision, "draft_vocab_coverage": {}}
    for kind in KINDS:
        rows = win.index(kind=kind, held=True)
        if len(rows):
            evaluation["draft_vocab_coverage"][kind] = coverage(win, rows, vocab)
    sets = {"answers": win.index(kind="answers", held=True),
            "corpus": np.concatenate([win.index(kind="prose", held=True), win.index(kind="code", held=True)])}
    for name, rows in sets.items():
        if len(rows):
            evaluation[name] = evaluate(stored, lm, win, rows, cfg.eval_positions, cfg.seed)
            _log_eval(name, evaluation[name])
    unseen = evaluate_unseen(stored, lm, cfg, cache, identity["sha256"])
    if unseen is not None:
        evaluation["unseen"] = unseen
        _log_eval("unseen", unseen)
    for kind in ("prose", "code"):
        rows = win.index(kind=kind, held=True)
        if len(rows):
            e = evaluate(stored, lm, win, rows, 0, cfg.seed)
            evaluation[kind] = {"depth1_teacher_forced": e["depth1_teacher_forced"], "positions": e["positions"]}
    wall["evaluate"] = time.perf_counter() - t
    wall["total"] = time.perf_counter() - t_start
    recipe.update(evaluation=evaluation, wall_s={k: round(v, 1) for k, v in wall.items()},
                  device=msgspec_builtins(bench.machine()), command=command,
                  file_bytes=out.stat().st_size)
    save_mtp(head, out, dtype=dtype, **recipe)
    log(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB) and {out.with_suffix('.json').name} "
        f"in {wall['total'] / 60:.1f} min")
    return json.loads(out.with_suffix(".json").read_text())


def msgspec_builtins(x: Any) -> Any:
    import msgspec

    return msgspec.to_builtins(x)


# -- command line ----------------------------------------------------------------------------------

def parse_data(spec: str) -> dict[str, int]:
    """``prose=192,code=96,answers=224`` -> counts (windows; prompts for answers)."""
    out: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, sep, n = item.partition("=")
        if not sep or kind not in KINDS or not n.isdigit():
            raise argparse.ArgumentTypeError(f"--data {spec!r}: expected kind=N,... with kinds {', '.join(KINDS)}")
        out[kind] = int(n)
    return out


def add_parser(subparsers) -> None:
    d = Config()
    p = subparsers.add_parser(
        "forge", help="train an MTP head for a model by self-distillation (offline data)",
        description="Train an MTP head for --model (default: the embedded one) on text of the installed "
                    "Python environment and the model's own answers, labelled by the model itself; write "
                    "OUT (.safetensors) and its recipe OUT.json with held-back acceptance. The defaults "
                    "are the shipped head's recipe.")
    p.add_argument("--model", "-m", default=None)
    p.add_argument("--out", type=Path, metavar="HEAD.safetensors")
    p.add_argument("--check", type=Path, default=None, metavar="HEAD",
                   help="train nothing: print HEAD's acceptance by depth on the unseen set (prompts "
                        "whose templates and topics no training answer used)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--data", type=parse_data, default={},
                   help=f"how much of each kind: prose=N,code=N (windows of --window tokens), answers=N "
                        f"(prompts); default prose={d.prose},code={d.code},answers={d.answers}")
    p.add_argument("--resume", action="store_true",
                   help="continue from OUT's training checkpoint (and the cached target pass)")
    p.add_argument("--cache", type=Path, default=None, metavar="DIR",
                   help="where answers and the target pass are kept (default: forge/ in the warmspec cache)")
    p.add_argument("--vocab", type=int, default=d.vocab, help="draft vocabulary size")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--unroll", type=int, default=d.unroll,
                   help="depths trained on the head's own state, as it drafts (1: the first only)")
    p.add_argument("--init", choices=("last-layer", "random"), default=d.init)
    p.add_argument("--precision", choices=("float16", "bfloat16", "float32"), default=d.precision)
    p.set_defaults(func=cmd_forge)


def cmd_forge(args: argparse.Namespace) -> int:
    from .core.mtp import MTPError
    from .model import ModelError, load

    if args.out is None and args.check is None:
        print("warmspec forge: --out HEAD.safetensors is required (or --check HEAD)", file=sys.stderr)
        return 2
    cfg = replace(Config(), steps=args.steps, seed=args.seed, vocab=args.vocab, lr=args.lr,
                  batch=args.batch, unroll=args.unroll, init=args.init, precision=args.precision, **args.data)
    try:
        # float32 on every device: the head starts as a float copy of the target's last layer, and
        # the labels are the same on a GPU (4-bit as stored) and on a CPU (dequantized anyway).
        lm = load(args.model, dequantize=True)
    except ModelError as e:
        print(f"warmspec: {e}", file=sys.stderr)
        return 1
    if args.check is not None:
        try:
            result = check(lm, args.check, cfg, cache=args.cache)
        except MTPError as e:
            print(f"warmspec: {e}", file=sys.stderr)
            return 1
        print(json.dumps(result, indent=1))
        return 0
    command = "warmspec forge " + " ".join(sys.argv[sys.argv.index("forge") + 1:]) if "forge" in sys.argv else None
    recipe = forge(lm, args.out, cfg, cache=args.cache, resume=args.resume, command=command)
    print(json.dumps(recipe["evaluation"], indent=1))
    return 0
