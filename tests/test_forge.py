"""``warmspec forge`` end to end on a tiny random model (seconds), heads with a reduced draft
vocabulary (drafts inside it, greedy exactness through the engine, sampled q zero outside it), the
recipe's checksum, and the head shipped for the default model (loads against it; refused for any
other weights). The training of the shipped head itself is not run here: it takes ~30 min of CPU.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

import tiny
from warmspec import fetch, forge, heads
from warmspec.core import mtp
from warmspec.core.engine import Engine, Finished
from warmspec.core.types import SamplingParams

CFG = forge.Config(prose=0, code=0, answers=0, answer_tokens=16, window=128, top_k=4, vocab=48,
                   steps=6, batch=4, crop=24, warmup=2, eval_positions=12, gen_batch=4, pass_batch=4,
                   unseen=3)


def texts() -> list[tuple[str, str, str]]:
    """A handful of short documents of each kind; names chosen to fall on both sides of the split."""
    out = [("prose", f"prose-{i}", f"The river {i} runs past the old mill and the bridge, "
                                    f"where children watch the boats go by. " * 2) for i in range(24)]
    out += [("code", f"code-{i}", f"def add_{i}(a, b):\n    return a + b + {i}\n\n" * 3) for i in range(12)]
    out += [("answers", f"answer-{i}", f"Tell me about the number {i}.") for i in range(10)]
    return out


@pytest.fixture(scope="module")
def forged(tmp_path_factory):
    root = tmp_path_factory.mktemp("forge")
    lm = tiny.build("llama")
    recipe = forge.forge(lm, root / "head.safetensors", CFG, cache=root / "cache", texts=texts())
    return lm, root, recipe


def test_forge_writes_a_head_that_loads_with_its_recipe(forged):
    lm, root, recipe = forged
    head = mtp.load_mtp(root / "head.safetensors", lm)
    assert head.draft_vocab is not None and head.draft_vocab.size == CFG.vocab
    assert recipe == json.loads((root / "head.json").read_text())
    assert recipe["format"] == mtp.FORMAT
    assert recipe["target"]["sha256"] == mtp.target_identity(lm)["sha256"]
    assert recipe["training"]["steps"] == CFG.steps and recipe["training"]["seed"] == CFG.seed
    assert recipe["training"]["lr"] == CFG.lr and recipe["training"]["vocab"] == CFG.vocab
    assert recipe["training"]["precision"] == "float16" and recipe["draft_vocab_size"] == CFG.vocab
    for kind in ("prose", "code", "answers"):
        assert recipe["data"][kind]["tokens"] > 0 and recipe["data"][kind]["windows"] > 0
    ev = recipe["evaluation"]
    for name in ("answers", "corpus"):
        assert 0.0 <= ev[name]["depth1_teacher_forced"] <= 1.0 and ev[name]["positions"] > 0
        assert len(ev[name]["accepted_by_depth"]) == forge.DEPTHS
        by_depth = ev[name]["accepted_by_depth"]
        assert all(a >= b for a, b in zip(by_depth, by_depth[1:]))  # cumulative: never rises
    assert set(ev["draft_vocab_coverage"]) >= {"prose", "answers"}
    assert ev["unseen"]["positions"] > 0 and len(ev["unseen"]["accepted_by_depth"]) == forge.DEPTHS
    assert recipe["sha256"] == fetch.sha256_file(root / "head.safetensors")
    assert recipe["wall_s"]["total"] > 0 and recipe["device"]["device"]
    assert recipe["file_bytes"] == (root / "head.safetensors").stat().st_size


def test_stored_head_is_float16(forged):
    _, root, _ = forged
    stored = mx.load(str(root / "head.safetensors"))
    assert stored["mtp.fc.weight"].dtype == mx.float16
    assert stored["mtp.draft_vocab"].dtype == mx.int32


def test_resume_continues_where_the_run_stopped(forged, tmp_path, monkeypatch):
    """A run interrupted after its checkpoint at step 4 and resumed ends with the weights of a run
    that never stopped: the batches are a function of (seed, step) and Adam's state is restored."""
    lm, root, _ = forged
    cfg = replace(CFG, steps=8)
    sha = mtp.target_identity(lm)["sha256"]
    docs = forge.collect(lm, cfg, root / "cache", sha, texts=texts())
    win = forge.target_pass(lm, docs, cfg, root / "cache", sha)
    vocab = forge.choose_vocab(win, cfg.vocab, 256)
    monkeypatch.setattr(forge, "CHECKPOINT_EVERY", 4)

    whole = forge.new_head(lm, vocab, cfg.init, cfg.seed)
    forge.train(whole, win, cfg, tmp_path / "a.ckpt.safetensors", resume=False)

    real_batch = forge.batch_at

    def stop_at_5(win, rows, index, cfg, step):
        if step == 5:
            raise KeyboardInterrupt
        return real_batch(win, rows, index, cfg, step)

    first = forge.new_head(lm, vocab, cfg.init, cfg.seed)
    monkeypatch.setattr(forge, "batch_at", stop_at_5)
    with pytest.raises(KeyboardInterrupt):
        forge.train(first, win, cfg, tmp_path / "b.ckpt.safetensors", resume=False)
    monkeypatch.setattr(forge, "batch_at", real_batch)
    before = json.loads((tmp_path / "b.ckpt.json").read_text())
    assert before["step"] == 4 and before["train_s"] >= 0

    resumed = forge.new_head(lm, vocab, cfg.init, cfg.seed)
    out = forge.train(resumed, win, cfg, tmp_path / "b.ckpt.safetensors", resume=True)
    assert out["resumed_from_step"] == 4
    assert out["train_s"] >= before["train_s"]  # the interrupted run's time is counted too
    a, b = dict(whole.parameters()["layers"][0]["mlp"]), dict(resumed.parameters()["layers"][0]["mlp"])
    np.testing.assert_allclose(np.array(a["up_proj"]["weight"]), np.array(b["up_proj"]["weight"]), atol=1e-5)
    np.testing.assert_allclose(np.array(whole.fc.weight), np.array(resumed.fc.weight), atol=1e-5)
    assert not np.allclose(np.array(whole.fc.weight), np.array(first.fc.weight), atol=1e-6)

    with pytest.raises(ValueError, match="other settings"):
        forge.train(forge.new_head(lm, vocab, cfg.init, cfg.seed), win, replace(cfg, lr=0.5),
                    tmp_path / "b.ckpt.safetensors", resume=True)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_unrolled_depths_are_what_the_head_computes_when_it_drafts(arch):
    """Training at depth d must see what drafting sees: the head's cache holding the pairs 0..j and
    its own depths 1..d-1 at j. Depth by depth, ``unrolled`` matches the head run incrementally on
    its cache, at every j (a mask or RoPE offset off by one fails here)."""
    lm = tiny.build(arch)
    head = forge.new_head(lm, np.arange(64, dtype=np.int32), "random", 3)
    rng = np.random.default_rng(1)
    C = 9
    hidden = mx.array(rng.standard_normal((1, C, lm.model.args.hidden_size)).astype(np.float32))
    tokens = mx.array(rng.integers(0, 256, (1, C)))
    outs = forge.unrolled(head, hidden, tokens, 3)
    assert [o[0].shape[1] for o in outs] == [C, C - 1, C - 2]
    for j in range(C - 2):
        cache = head.make_cache()
        logits, g = head(hidden[:, :j + 1], tokens[:, :j + 1], cache)
        np.testing.assert_allclose(np.array(outs[0][0][0, j]), np.array(logits[0, j]), atol=2e-4, rtol=2e-4)
        g = g[:, j:]
        for d in (1, 2):
            logits, g = head(g, tokens[:, j + d:j + d + 1], cache)
            np.testing.assert_allclose(np.array(outs[d][0][0, j]), np.array(logits[0, 0]), atol=2e-4, rtol=2e-4)
            np.testing.assert_allclose(np.array(outs[d][1][0, j]), np.array(g[0, 0]), atol=2e-4, rtol=2e-4)


def test_unrolled_training_runs_and_is_recorded(forged, tmp_path):
    lm, root, _ = forged
    cfg = replace(CFG, unroll=3)
    recipe = forge.forge(lm, tmp_path / "u.safetensors", cfg, cache=root / "cache", texts=texts())
    assert recipe["training"]["unroll"] == 3 and np.isfinite(recipe["training"]["final_loss"])


def test_unseen_prompts_share_no_template_or_topic_with_training_nor_the_bench():
    """The unseen set is what forge reports as a user's prompts: none of its phrasings or topics
    may be one the training answers used, and none of its prompts one the bench measures."""
    unseen = forge.unseen_prompts(1000)
    assert len(unseen) == len(set(unseen)) == len(forge.UNSEEN_TEMPLATES) * len(forge.UNSEEN_TOPICS)
    assert not set(forge.UNSEEN_TOPICS) & set(forge.TOPICS)
    assert not set(forge.UNSEEN_TEMPLATES) & set(forge.TEMPLATES)
    trained = set(forge.prompts(10 ** 6, 0))
    assert not trained & set(unseen)
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    for f in root.glob("bench/*.jsonl"):
        for line in f.read_text().splitlines():
            assert json.loads(line)["messages"][-1]["content"] not in unseen


def test_check_measures_a_head_on_the_unseen_set_without_training(forged, tmp_path):
    lm, root, recipe = forged
    out = forge.check(lm, root / "head.safetensors", CFG, cache=root / "cache")
    assert out["unseen"] == recipe["evaluation"]["unseen"]  # the same answers, the same head
    other = tiny.build("qwen3")
    with pytest.raises(mtp.MTPError):
        forge.check(other, root / "head.safetensors", CFG, cache=tmp_path)


def test_tampered_head_is_refused(forged, tmp_path):
    lm, root, _ = forged
    for suffix in (".safetensors", ".json"):
        shutil.copy(root / f"head{suffix}", tmp_path / f"head{suffix}")
    data = bytearray((tmp_path / "head.safetensors").read_bytes())
    data[-3] ^= 0x40  # a weight's bits, not the header
    (tmp_path / "head.safetensors").write_bytes(bytes(data))
    with pytest.raises(mtp.MTPError, match="SHA-256 does not match"):
        mtp.load_mtp(tmp_path / "head.safetensors", lm)


def test_heads_without_checksum_or_vocabulary_still_load(tmp_path):
    """Files written before the draft vocabulary and the checksum existed."""
    lm = tiny.build("qwen3")
    head = mtp.MTPHead(mtp.target_parts(lm.model))
    mx.eval(head.parameters())
    mtp.save_mtp(head, tmp_path / "old.safetensors")
    meta = json.loads((tmp_path / "old.json").read_text())
    del meta["sha256"]
    (tmp_path / "old.json").write_text(json.dumps(meta))
    again = mtp.load_mtp(tmp_path / "old.safetensors", lm)
    assert again.draft_vocab is None


# -- the draft vocabulary --------------------------------------------------------------------------

VOCAB = np.arange(3, 256, 5)  # 51 of the 256 ids


def vocab_head(arch: str = "llama"):
    lm = tiny.build(arch)
    head = mtp.MTPHead(mtp.target_parts(lm.model), draft_vocab=VOCAB)
    mx.eval(head.parameters())
    return lm, head


def test_draft_vocab_head_drafts_only_its_ids_and_round_trips(tmp_path):
    lm, head = vocab_head()
    tokens = np.random.default_rng(0).integers(0, 256, 20).tolist()
    _, hidden = mtp.forward_hidden(lm.model, mx.array([tokens]))
    logits, _ = head(hidden[:, :-1], mx.array([tokens[1:]]))
    assert logits.shape[-1] == VOCAB.size
    drafts, q, _ = head.draft(hidden[:, :-1], mx.array([tokens[1:]]), head.make_cache(), 6)
    assert q is None and set(drafts) <= set(VOCAB.tolist())
    mtp.save_mtp(head, tmp_path / "v.safetensors", dtype=mx.float16)
    again = mtp.load_mtp(tmp_path / "v.safetensors", lm)
    np.testing.assert_array_equal(again.draft_vocab, VOCAB)


def test_sampled_q_has_no_mass_outside_the_draft_vocab():
    lm, head = vocab_head()
    tokens = np.random.default_rng(1).integers(0, 256, 16).tolist()
    _, hidden = mtp.forward_hidden(lm.model, mx.array([tokens]))
    params = SamplingParams(temperature=1.0, top_p=0.95)
    drafts, qs, _ = head.draft(hidden[:, :-1], mx.array([tokens[1:]]), head.make_cache(), 4, params,
                               np.random.default_rng(0))
    outside = np.setdiff1d(np.arange(256), VOCAB)
    for d, q in zip(drafts, qs):
        assert q.shape == (256,) and q[outside].sum() == 0.0
        assert q.sum() == pytest.approx(1.0) and q[d] > 0 and d in VOCAB


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_with_a_draft_vocab_head_is_greedy_exact(arch):
    """A head trained for nothing drafts mostly wrong tokens inside its vocabulary; the output
    must still be plain decoding's, token for token."""
    lm, head = vocab_head(arch)
    prompt = np.random.default_rng(2).integers(0, 256, 12).tolist()

    def run(engine):
        out = []
        for ev in engine.generate(prompt, SamplingParams(), max_tokens=40):
            if isinstance(ev, Finished):
                return out, ev.stats
            out.extend(ev.tokens)

    plain, _ = run(Engine(lm, speculate=False))
    spec, stats = run(Engine(lm, mtp=head, gated=False))
    assert spec == plain
    assert stats.sources["mtp"].drafted > 0


# -- the shipped head ------------------------------------------------------------------------------

needs_head = pytest.mark.skipif(not heads.DEFAULT_HEAD.exists(),
                                reason="no head shipped for the default model in this checkout (warmspec forge makes it)")


@needs_head
def test_shipped_head_attaches_to_the_default_model(default_lm):
    recipe = mtp.read_recipe(heads.DEFAULT_HEAD)
    assert heads.DEFAULT_HEAD.stat().st_size <= 10_000_000
    assert recipe["target"]["sha256"] == mtp.target_identity(default_lm)["sha256"]
    ev = recipe["evaluation"]
    # held-back text, every position: depth-1 agreement at least 50% (corpus 54.7%, answers 62.6%)
    held = [ev["corpus"], ev["answers"]]
    agreed = sum(e["depth1_teacher_forced"] * e["positions"] for e in held)
    assert agreed / sum(e["positions"] for e in held) >= 0.5
    assert ev["corpus"]["depth1_teacher_forced"] >= 0.5 and ev["answers"]["depth1_teacher_forced"] >= 0.5
    assert ev["corpus"]["accepted_by_depth"][0] >= 0.5 and ev["answers"]["accepted_by_depth"][0] >= 0.5
    head = heads.default_head(default_lm)
    assert head is not None and head.draft_vocab.size == recipe["draft_vocab_size"]


@needs_head
def test_forge_defaults_are_the_shipped_heads_recipe():
    """``warmspec forge --out H`` with no other option trains what was shipped: every setting the
    recipe records equals ``Config``'s default (a changed default without a new head fails here)."""
    from dataclasses import asdict

    trained = mtp.read_recipe(heads.DEFAULT_HEAD)["training"]
    defaults = asdict(forge.Config())
    trained.setdefault("unroll", 1)  # recorded since the option exists
    assert {k: trained[k] for k in defaults if k in trained} == {k: v for k, v in defaults.items() if k in trained}
    assert set(defaults) - set(trained) == set(forge.EVALUATION_ONLY)


@needs_head
def test_the_shipped_head_drafts_by_default_on_a_cpu(default_lm, monkeypatch):
    """With the default model and no drafting option, the shipped head drafts beside n-gram
    lookup on a CPU (measured to pay there) and not on a GPU (measured not to); ``--mtp off``
    turns it off, ``--mtp shipped`` on anywhere; another model or ``--no-speculate`` get no
    head."""
    import argparse
    from pathlib import Path

    from warmspec import model as model_mod
    from warmspec.server.daemon import engine_for

    def args(**kw):
        return argparse.Namespace(**{**dict(model=None, mtp=None, draft_model=None, no_speculate=False,
                                            max_draft=None), **kw})

    engine = engine_for(default_lm, args())
    assert engine.drafting == "ngram+mtp" and engine.mtp is not None and engine.mtp.draft_vocab is not None
    assert engine_for(default_lm, args(mtp=Path("off"))).drafting == "ngram"
    assert engine_for(default_lm, args(no_speculate=True)).mtp is None
    assert engine_for(default_lm, args(model="some/other-model")).mtp is None
    monkeypatch.setattr(model_mod, "on_cpu", lambda: False)  # what a GPU gets
    assert engine_for(default_lm, args()).drafting == "ngram"
    assert engine_for(default_lm, args(mtp=Path("shipped"))).drafting == "ngram+mtp"


def test_shipped_is_refused_for_a_model_without_a_shipped_head():
    """``--mtp shipped`` means one thing to ``serve`` and ``bench`` (one resolver): on another
    model both refuse it with the same reason, instead of starting without the head."""
    import argparse

    from warmspec.bench import model_drafters
    from warmspec.model import ModelError
    from warmspec.server.daemon import engine_for

    lm = tiny.build("llama")
    with pytest.raises(mtp.MTPError, match="no usable head is shipped for this model"):
        heads.resolve_head("shipped", lm)
    args = argparse.Namespace(model=None, mtp="shipped", draft_model=None, no_speculate=False, max_draft=None)
    with pytest.raises(ModelError, match="--mtp shipped: no usable head is shipped"):
        engine_for(lm, args)
    with pytest.raises(ValueError, match="mode mtp: --mtp shipped: no usable head is shipped"):
        model_drafters(lm, ["ngram+mtp"], None, None)


@needs_head
def test_shipped_head_for_other_weights_is_refused(default_lm, tmp_path, caplog):
    for suffix in (".safetensors", ".json"):
        shutil.copy(heads.DEFAULT_HEAD.with_suffix(suffix), tmp_path / f"h{suffix}")
    recipe = json.loads((tmp_path / "h.json").read_text())
    recipe["target"]["sha256"] = "0" * 64
    (tmp_path / "h.json").write_text(json.dumps(recipe))
    with pytest.raises(mtp.MTPError, match=r"was trained for SmolLM2-135M-Instruct\.Q4_1\.gguf "
                                           r"\(sha256 000000000000…\), but the loaded model"):
        mtp.check_target(tmp_path / "h.safetensors", default_lm)
    with caplog.at_level(logging.WARNING, logger="warmspec.heads"):
        assert heads.default_head(default_lm, tmp_path / "h.safetensors") is None
    assert "n-gram lookup only" in caplog.text and "was trained for" in caplog.text
