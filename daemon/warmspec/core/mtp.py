"""MTP heads (DeepSeek-V3 / Qwen3-Next / Qwen3.5 / Qwen3.6 structure), attached to a loaded target.

A head predicts the token after next. At position i it takes the target's hidden state h_i (the
state that predicted token t_{i+1}) and the embedding of t_{i+1}, and returns logits for t_{i+2}:

    x = fc(concat[pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)])
    x = layer(x, own KV cache)          # one decoder layer of the target's full-attention kind
    g = norm(x)                         # the head's own ``mtp.norm`` (else the target's final norm)
    logits = lm_head(g)                 # the target's output head (tied: embed_tokens.as_linear)

Depth k > 1 feeds the head its own ``g`` and its own chosen token. The embedding, final norm and
output head are the target's own modules, held by reference: a head adds only its own parameters
(the seeds' duplicate-weights trap took Qwen3.5-9B from 6.5 GB to 16.7 GB peak).

What the sources say, and what this module therefore does:

- Concatenation order: EMBEDDING FIRST, then the hidden state.
  vLLM ``vllm/model_executor/models/qwen3_5_mtp.py`` (stored commit 01d99805),
  ``Qwen3_5MultiTokenPredictor.forward``: ``torch.cat([inputs_embeds, hidden_states], dim=-1)``
  after ``pre_fc_norm_embedding`` / ``pre_fc_norm_hidden``, then ``self.fc``; the same in
  ``qwen3_next_mtp.py`` (055e47c2) and ``deepseek_mtp.py`` (03356f8c:
  ``self.eh_proj(torch.cat([inputs_embeds, previous_hidden_states], dim=-1))``). llama.cpp
  ``src/models/qwen35.cpp`` (06e514f6), ``graph_mtp``: ``ggml_concat(ctx0, e_norm, h_norm, 0)``.
  Megatron-LM (the trainer; d98e8a64) ``megatron/core/transformer/multi_token_prediction.py:1341``:
  ``torch.cat((decoder_input, hidden_states), -1)`` before ``eh_proj``.
- Which hidden state: the target's FINAL-NORM OUTPUT (the tensor its lm_head scores), not the
  pre-norm residual stream. The issue assumed the residual; every reference disagrees:
  vLLM ``qwen3_next.py`` (002d6073) ``Qwen3NextModel.forward`` ends
  ``hidden_states, _ = self.norm(hidden_states, residual)`` / ``return hidden_states``, and
  ``compute_logits`` applies only ``lm_head`` to that tensor; ``vllm/v1/worker/gpu_model_runner.py``
  hands the drafter that same tensor (``target_hidden_states = hidden_states[:num_scheduled_tokens]``),
  for DeepSeek-V3 as for Qwen. llama.cpp ``qwen35.cpp`` sets ``res->t_h_nextn`` after
  ``build_norm(cur, output_norm_w, ...)``; llama.cpp PR #24025 ("qwen35: use post-norm hidden state
  for MTP") moved there from the pre-norm state, measured on Qwen3.6 (e.g. code_python acceptance
  0.807 -> 0.834; aggregate 0.686 before).
  Megatron-LM trains the head on the decoder output after the block's ``final_layernorm``
  (``transformer_block.py:755-756``, handed to ``self.mtp`` at ``gpt_model.py:712``).
  ``forward_hidden`` below returns that tensor; the target pass must hand the head the same one.
- Final norm: the head's OWN ``mtp.norm`` where the checkpoint has one (Qwen3.5/3.6/Next: vLLM
  ``self.norm(hidden_states, residual)`` at the end of the predictor; DeepSeek: ``shared_head.norm``;
  llama.cpp: ``nextn.shared_head_norm``, falling back to ``output_norm``). A standalone head may
  declare ``"final_norm": "target"`` to use the target's.
- Depth > 1 recycles the head's post-``mtp.norm`` output (vLLM's predictor returns it; llama.cpp's
  MTP graph sets ``t_h_nextn`` after ``shared_head_norm``; Megatron's layer ends in its
  ``final_layernorm`` at ``multi_token_prediction.py:1439``).
- RoPE position: the pair (h_i, t_{i+1}) sits at position i, the position of h_i (vLLM's drafter
  reuses the target's positions). Here that is simply the head cache's offset.
- Norm weights: Qwen3.5/3.6/Next checkpoints store every RMSNorm zero-centred (the model applies
  1 + w). mlx-lm adds 1 to the target's norms when loading a raw checkpoint and drops ``mtp.*``;
  converters that keep them copy ``mtp.*`` raw (mlx-lm PR #1543 ``--preserve-mtp``) and mlx-vlm
  shifts exactly the ``mtp.``-named tensors (PR #1554). So for those families every ``mtp.*norm.weight``
  read from a checkpoint directory gets +1. Standalone heads store the gamma they use.

Formats read by ``load_mtp``:
- a checkpoint directory (MLX or Hugging Face) whose config declares ``mtp_num_hidden_layers`` or
  ``num_nextn_predict_layers`` (top level or in ``text_config``), with the ``mtp.*`` tensors in its
  safetensors (``*.safetensors.index.json`` shards honoured; only the shards and tensors of the head
  are ever read: ``mx.load`` is lazy and the rest are dropped unevaluated);
- a standalone head: ``NAME.safetensors`` of ``mtp.*`` tensors and ``NAME.json`` beside it
  (``save_mtp`` writes both; ``warmspec forge`` will, for models without a head).
Names follow Qwen3.5: ``mtp.fc.weight``, ``mtp.pre_fc_norm_embedding.weight``,
``mtp.pre_fc_norm_hidden.weight``, ``mtp.layers.0.<the decoder layer's mlx-lm names>``,
``mtp.norm.weight``; MoE experts per expert (``mlp.experts.E.gate_proj.weight``) or fused
(``mlp.experts.gate_up_proj``) are stacked into mlx-lm's ``switch_mlp``.

Reduced draft vocabulary (EAGLE-3, FR-Spec): a head may carry ``mtp.draft_vocab``, an int32 list
of target token ids; it then scores only those rows of the target's output head (gathered once
from the target, dequantized when the target is quantized; not stored in the head) and drafts
only those ids. Why: on the default model (SmolLM2-135M, vocabulary 49152, hidden 576) the output
projection is ~20% of a target forward, so a head scoring the whole vocabulary costs about a
quarter of a target step per depth, while 4096 rows cost ~2% and hold ~95% of the target's own
next-next tokens (measured by ``warmspec forge``). Sampled drafts keep exactness: ``q`` is the
head's distribution over the subset and zero elsewhere, and rejection sampling only needs the q
the draft was drawn from. A standalone recipe may carry ``sha256`` (of the .safetensors file):
a file that does not match it is refused.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache

from .types import SamplingParams

from .cache import trimmable_kind
from ..fetch import sha256_file
from ..model import LoadedModel
from .sampling import host_row, probabilities, sample

FORMAT = "warmspec-mtp-head"
ZERO_CENTRED_NORMS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
CONFIG_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")


class MTPError(ValueError):
    """A head that cannot be loaded or does not fit the target; ``str()`` is one line for the user."""


# -- the target's parts ---------------------------------------------------------------------------

@dataclass(frozen=True)
class TargetParts:
    """References into the loaded target (not an ``nn.Module``: a head holding it registers none of
    these as its own parameters)."""

    model: nn.Module   # the target as loaded
    text: nn.Module    # the module with ``.model`` (and ``.lm_head`` when untied)
    inner: nn.Module   # embed_tokens, layers, norm
    args: Any
    template: int      # index of the target layer whose kind the head's decoder layer copies

    @property
    def embed(self) -> nn.Module:
        return self.inner.embed_tokens

    @property
    def norm(self) -> nn.Module:
        return self.inner.norm

    @property
    def hidden_size(self) -> int:
        return int(self.args.hidden_size)

    def logits(self, h: mx.array) -> mx.array:
        return _score(self.text, self.inner, h)

    @property
    def output(self) -> nn.Module:
        """The module that scores: ``lm_head``, or the embedding when tied."""
        head = getattr(self.text, "lm_head", None)
        return head if head is not None else self.inner.embed_tokens

    @property
    def vocab_size(self) -> int:
        return int(self.output.weight.shape[0])

    def output_rows(self, ids: mx.array) -> tuple[mx.array, mx.array | None]:
        """The output head's rows (and bias) for ``ids``, dense in the target's float dtype:
        quantized heads are dequantized row by row (a (len(ids), hidden) copy, nothing else)."""
        mod = self.output
        if "scales" in mod:
            biases = mod.get("biases")
            w = mx.dequantize(mod.weight[ids], mod.scales[ids], None if biases is None else biases[ids],
                              group_size=mod.group_size, bits=mod.bits, mode=mod.mode)
        else:
            w = mod.weight[ids]
        bias = mod.get("bias")
        return w, None if bias is None else bias[ids]


def _split(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    text = getattr(model, "language_model", model)
    inner = getattr(text, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
        raise MTPError(f"{type(model).__module__}: no embed_tokens/layers/norm to attach a head to")
    return text, inner


def _score(text: nn.Module, inner: nn.Module, h: mx.array) -> mx.array:
    head = getattr(text, "lm_head", None)
    return head(h) if head is not None else inner.embed_tokens.as_linear(h)


def target_parts(model: nn.Module) -> TargetParts:
    """Find the embedding, layers, final norm and output head of an mlx-lm model; the template layer
    is the last one whose cache is a plain trimmable KV cache (Qwen3.5: a full-attention layer;
    Gemma 3: a global layer), so the head's own cache rolls back by trimming."""
    text, inner = _split(model)
    kinds = make_prompt_cache(model)
    template = max((i for i, c in enumerate(kinds) if trimmable_kind(c)), default=None)
    if template is None:
        raise MTPError(f"{type(model).__module__}: no full-attention layer for the head to copy")
    return TargetParts(model=model, text=text, inner=inner, args=text.args, template=template)


def check_parts(parts: TargetParts) -> None:
    """The head scores its state with ``parts.logits``; that must be what the target's own forward
    does after its final norm (families that scale or cap logits after the head would not be)."""
    probe = mx.array([[0, 1, 2]])
    want = parts.model(probe)
    got = parts.logits(parts.inner(probe))
    if not mx.allclose(got, want, rtol=1e-3, atol=1e-3 * float(mx.abs(want).max())).item():
        raise MTPError(f"{type(parts.model).__module__}: its logits are not lm_head(final norm); "
                       "an MTP head cannot be attached to this family")


def forward_hidden(model: nn.Module, inputs: mx.array, cache: Any = None) -> tuple[mx.array, mx.array]:
    """The target's logits and the hidden state an MTP head conditions on: the final-norm output,
    i.e. exactly what the output head scores (mlx-lm's inner models end in ``self.norm``)."""
    text, inner = _split(model)
    h = inner(inputs, cache=cache)
    return _score(text, inner, h), h


# -- the head ---------------------------------------------------------------------------------------

def _decoder_layer(parts: TargetParts) -> nn.Module:
    """A fresh layer of the template layer's class, built from the target's args (mlx-lm layer
    classes take ``(args)`` or ``(args, layer_idx)``; the index picks the full-attention kind)."""
    cls = type(parts.inner.layers[parts.template])
    kwargs = {"layer_idx": parts.template} if "layer_idx" in inspect.signature(cls).parameters else {}
    return cls(parts.args, **kwargs)


class MTPHead(nn.Module):
    """``head(hidden, tokens, cache) -> (logits, hidden_out)``.

    ``hidden`` (B, L, D): the target's final-norm hidden states at positions p .. p+L-1 (or the
    head's own ``hidden_out`` at depth > 1); ``tokens`` (B, L): the token that followed each of those
    positions; ``cache``: ``make_cache()``, at offset p. ``logits[:, j]`` predict the token at position
    p+j+2 (over ``draft_vocab``'s columns when the head has one: ``to_target`` maps them back);
    ``hidden_out`` is the post-norm state to feed back for the next depth.
    """

    def __init__(self, parts: TargetParts, *, own_norm: bool = True, eps: float | None = None,
                 draft_vocab: Sequence[int] | np.ndarray | None = None):
        super().__init__()
        d = parts.hidden_size
        eps = float(getattr(parts.args, "rms_norm_eps", 1e-6) if eps is None else eps)
        self._parts = parts  # a plain attribute: not a child module, not saved, not counted
        self.pre_fc_norm_embedding = nn.RMSNorm(d, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(d, eps=eps)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.layers = [_decoder_layer(parts)]
        if own_norm:
            self.norm = nn.RMSNorm(d, eps=eps)
        # Underscored: not parameters (not trained, not saved with them, not counted).
        self._vocab_ids: np.ndarray | None = None
        self._vocab: mx.array | None = None
        self._rows: tuple[mx.array, mx.array | None] | None = None
        if draft_vocab is not None:
            ids = np.asarray(draft_vocab, dtype=np.int64).reshape(-1)
            if ids.size == 0 or len(np.unique(ids)) != ids.size:
                raise MTPError("a draft vocabulary must be a non-empty list of distinct token ids")
            if ids.min() < 0 or ids.max() >= parts.vocab_size:
                raise MTPError(f"draft vocabulary ids must lie in [0, {parts.vocab_size}) for this "
                               f"target; got {ids.min()}..{ids.max()}")
            self._vocab_ids = ids.astype(np.int32)
            self._vocab = mx.array(self._vocab_ids)

    @property
    def parts(self) -> TargetParts:
        return self._parts

    @property
    def draft_vocab(self) -> np.ndarray | None:
        """The target ids the head scores (its logits' columns), or None: the whole vocabulary."""
        return self._vocab_ids

    def retarget(self, model: nn.Module | None) -> None:
        """Attach to ``model`` (the same target, loaded again), or let go of it (None)."""
        self._parts = None if model is None else target_parts(model)
        self._rows = None  # gathered from the new target on first use

    def ready(self) -> None:
        """Gather the draft vocabulary's output rows from the target now (not inside a traced
        function, nor in the middle of an answer); a no-op without a draft vocabulary."""
        if self._vocab is not None and self._rows is None:
            self._rows = self._parts.output_rows(self._vocab)
            mx.eval(self._rows)

    def score(self, g: mx.array) -> mx.array:
        """Logits over the target's vocabulary, or over the draft vocabulary's columns."""
        if self._vocab is None:
            return self._parts.logits(g)
        self.ready()
        w, b = self._rows
        out = g @ w.T
        return out if b is None else out + b

    def to_target(self, index: int) -> int:
        """A column of the head's logits as a target token id."""
        return index if self._vocab_ids is None else int(self._vocab_ids[index])

    def make_cache(self) -> list[Any]:
        return [make_prompt_cache(self._parts.model)[self._parts.template]]

    def __call__(self, hidden: mx.array, tokens: mx.array, cache: list[Any] | None = None
                 ) -> tuple[mx.array, mx.array]:
        x = self.fuse(hidden, tokens)
        c = cache[0] if cache is not None else None
        return self.finish(self.layers[0](x, create_attention_mask(x, c), c))

    def fuse(self, hidden: mx.array, tokens: mx.array) -> mx.array:
        """The decoder layer's input: the token's embedding and the hidden state, normed, joined."""
        e = self.pre_fc_norm_embedding(self._parts.embed(tokens))
        return self.fc(mx.concatenate([e, self.pre_fc_norm_hidden(hidden)], axis=-1))

    def finish(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """The decoder layer's output normed (``hidden_out``) and scored."""
        g = self.norm(x) if "norm" in self else self._parts.norm(x)
        return self.score(g), g

    @staticmethod
    def offset(cache: list[Any]) -> int:
        return int(cache[0].offset)

    @staticmethod
    def rewind(cache: list[Any], n: int) -> None:
        """Keep the first ``n`` positions (the head's cache is a trimmable KV cache)."""
        drop = int(cache[0].offset) - n
        if drop < 0:
            raise ValueError(f"cannot rewind a head cache of {cache[0].offset} positions to {n}")
        if drop:
            cache[0].trim(drop)

    def draft(self, hidden: mx.array, tokens: mx.array, cache: list[Any], k: int,
              params: SamplingParams | None = None, rng: np.random.Generator | None = None
              ) -> tuple[list[int], list[np.ndarray] | None, float]:
        """Consume the newly committed pairs, then propose ``k`` tokens.

        ``hidden`` (1, L, D) / ``tokens`` (1, L), L >= 1: the target's hidden states of the positions
        committed since the last call and the tokens that followed them; the last pair is (the
        state of the last committed position, the token the target just chose), so the first draft
        comes from it. Drafts 2..k feed back the head's own ``hidden_out`` and token. The cache
        keeps the committed pairs only: the k-1 speculative positions are trimmed before returning
        (their hidden inputs were the head's, not the target's, so they would be replaced anyway).
        Greedy when ``params`` is None or greedy; otherwise each draft is sampled from
        ``distribution(logits, params)`` (the target's own processing) and those rows are the q
        (over the target's vocabulary; with a draft vocabulary, zero outside it).
        """
        keep = self.offset(cache) + tokens.shape[1]
        logits, g = self(hidden, tokens, cache)
        row, g = logits[0, -1], g[:, -1:]
        greedy = params is None or params.greedy
        if greedy:
            drafted, first = self._draft_greedy(row, g, cache, k)
            self.rewind(cache, keep)
            return drafted, None, first
        drafted: list[int] = []
        qs: list[np.ndarray] = []
        first = 0.0
        for j in range(k):
            q = host_row(probabilities(row[None], params)[0])
            i = sample(q, rng)
            first = first or float(q[i])
            if self._vocab_ids is not None:  # the subset's q, zero outside it
                full = np.zeros(self._parts.vocab_size, dtype=q.dtype)
                full[self._vocab_ids] = q
                q = full
            tok = self.to_target(i)
            qs.append(q)
            drafted.append(tok)
            if j + 1 < k:
                logits, g = self(g, mx.array([[tok]]), cache)
                row = logits[0, -1]
        self.rewind(cache, keep)
        return drafted, qs, first

    def draft_lazy(self, hidden: mx.array, tokens: mx.array, cache: list[Any], k: int) -> mx.array:
        """Greedy ``draft`` left on the device: the (k,) target ids, not computed yet. The verify
        pass is queued on them and reads them back with its own result (see ``Proposal.device``):
        one round trip a step instead of two."""
        keep = self.offset(cache) + tokens.shape[1]
        logits, g = self(hidden, tokens, cache)
        out = self._greedy_ids(logits[0, -1], g[:, -1:], cache, k)
        self.rewind(cache, keep)
        return out

    def _greedy_ids(self, row: mx.array, g: mx.array, cache: list[Any], k: int) -> mx.array:
        """Greedy drafts 1..k as one graph: each depth feeds its argmax (mapped to a target id on
        the device) to the next without a host round trip. Reading each depth's token back cost
        a device sync per depth; on an H200 that made the head's proposals cost more than the
        passes they saved (ngram+mtp 1.20x plain on the public prose, where n-gram alone ran
        1.89x)."""
        ids = []
        best = mx.argmax(row)
        for j in range(k):
            tok = best if self._vocab is None else self._vocab[best]
            ids.append(tok)
            if j + 1 < k:
                logits, g = self(g, tok.reshape(1, 1), cache)
                best = mx.argmax(logits[0, -1])
        return mx.stack(ids)

    def _draft_greedy(self, row: mx.array, g: mx.array, cache: list[Any], k: int) -> tuple[list[int], float]:
        """Greedy drafts 1..k read back once, with the head's probability of the first (the
        gate's confidence)."""
        top = mx.softmax(row.astype(mx.float32))[mx.argmax(row)]
        out = self._greedy_ids(row, g, cache, k)
        mx.eval(out, top)
        return [int(t) for t in out.tolist()], float(top.item())


# -- loading ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Recipe:
    """How to read a head's tensors: how many layers, +1 on norms, whose final norm, quantization."""

    num_layers: int = 1
    norm_offset: float = 0.0
    own_norm: bool = True
    quantization: dict[str, Any] | None = None


def declared_layers(config: dict[str, Any]) -> int:
    for scope in (config, config.get("text_config") or {}):
        for key in CONFIG_KEYS:
            if scope.get(key):
                return int(scope[key])
    return 0


def _model_type(config: dict[str, Any]) -> str:
    text = config.get("text_config") or {}
    return str(config.get("model_type") or text.get("model_type") or "")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise MTPError(f"{path}: cannot read ({e})") from None


def _shards(path: Path) -> list[Path]:
    """The safetensors files that may hold ``mtp.*`` tensors: from the index files where there are
    any (``model.safetensors.index.json``, mlx-lm's ``mtp.safetensors.index.json``), else every
    ``*.safetensors`` in the directory."""
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if not indexes:
        return sorted(path.glob("*.safetensors"))
    files: set[str] = set()
    for ix in indexes:
        weight_map = _read_json(ix).get("weight_map", {})
        files |= {f for name, f in weight_map.items() if name.startswith("mtp.")}
    return [path / f for f in sorted(files)]


def _read_mtp(files: Sequence[Path]) -> dict[str, mx.array]:
    """Every ``mtp.*`` tensor, prefix stripped; the others are dropped before anything reads them."""
    out: dict[str, mx.array] = {}
    for f in files:
        try:
            loaded = mx.load(str(f))
        except (OSError, RuntimeError, ValueError) as e:
            raise MTPError(f"{f}: cannot read safetensors ({e})") from None
        out.update({k[len("mtp."):]: v for k, v in loaded.items() if k.startswith("mtp.")})
        del loaded
    return out


def read_checkpoint(path: Path) -> tuple[dict[str, mx.array], Recipe]:
    """The head's tensors and recipe from an MLX or Hugging Face checkpoint directory."""
    config = _read_json(path / "config.json") if (path / "config.json").exists() else {}
    n = declared_layers(config)
    if n == 0:
        raise MTPError(f"{path}: config.json declares no MTP layers ({' / '.join(CONFIG_KEYS)})")
    text = config.get("text_config") or config
    if text.get("mtp_use_dedicated_embeddings"):
        raise MTPError(f"{path}: MTP heads with their own embeddings are not supported")
    weights = _read_mtp(_shards(path))
    if not weights:
        raise MTPError(f"{path}: config.json declares {n} MTP layer(s) but its safetensors hold no "
                       "mtp.* tensors; converters often strip them (mlx-lm drops mtp.*): use the "
                       "original Hugging Face checkpoint or a conversion that keeps them")
    offset = 1.0 if _model_type(config).startswith(ZERO_CENTRED_NORMS) else 0.0
    return weights, Recipe(num_layers=n, norm_offset=offset, quantization=config.get("quantization"))


def read_standalone(path: Path) -> tuple[dict[str, mx.array], Recipe]:
    """A ``NAME.safetensors`` of ``mtp.*`` tensors with its ``NAME.json`` recipe beside it."""
    meta_path = path.with_suffix(".json")
    if not meta_path.exists():
        raise MTPError(f"{path}: a standalone head needs its recipe {meta_path.name} beside it")
    meta = _read_json(meta_path)
    if meta.get("format") != FORMAT:
        raise MTPError(f"{meta_path}: not a warmspec MTP head (format {meta.get('format')!r})")
    if meta.get("hidden", "final_norm") != "final_norm":
        raise MTPError(f"{meta_path}: heads conditioned on {meta['hidden']!r} are not supported")
    if meta.get("final_norm", "own") not in ("own", "target"):
        raise MTPError(f"{meta_path}: final_norm must be 'own' or 'target'")
    if meta.get("sha256") is not None and sha256_file(path) != meta["sha256"]:
        raise MTPError(f"{path}: its SHA-256 does not match the one in {meta_path.name}: the file "
                       "is damaged or was changed after it was written")
    weights = _read_mtp([path])
    if not weights:
        raise MTPError(f"{path}: no mtp.* tensors")
    return weights, Recipe(num_layers=int(meta.get("num_layers", 1)),
                           norm_offset=float(meta.get("norm_offset", 0.0)),
                           own_norm=meta.get("final_norm", "own") == "own",
                           quantization=meta.get("quantization"))


def _stack_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Per-expert (``experts.E.gate_proj.weight``) and fused (``experts.gate_up_proj``) MoE tensors
    into mlx-lm's ``switch_mlp`` layout, as the target's sanitize does for its own layers."""
    out = dict(weights)
    for key in [k for k in weights if k.endswith(".experts.gate_up_proj")]:
        prefix = key[: -len(".experts.gate_up_proj")]
        gate_up = out.pop(key)
        mid = gate_up.shape[-2] // 2
        out[f"{prefix}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        out[f"{prefix}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        out[f"{prefix}.switch_mlp.down_proj.weight"] = out.pop(f"{prefix}.experts.down_proj")
    groups: dict[tuple[str, str], dict[int, mx.array]] = {}
    for key in [k for k in out if ".experts." in k and k.endswith("_proj.weight")]:
        prefix, rest = key.split(".experts.", 1)
        e, proj = rest.split(".", 1)
        groups.setdefault((prefix, proj), {})[int(e)] = out.pop(key)
    for (prefix, proj), by_e in groups.items():
        out[f"{prefix}.switch_mlp.{proj}"] = mx.stack([by_e[e] for e in sorted(by_e)])
    return out


def _prepare(weights: dict[str, mx.array], recipe: Recipe) -> dict[str, mx.array]:
    weights = _stack_experts(weights)
    if recipe.norm_offset:
        weights = {k: v + recipe.norm_offset if k.endswith("norm.weight") and v.ndim == 1 else v
                   for k, v in weights.items()}
    return weights


def _float_dtype(parts: TargetParts) -> mx.Dtype:
    w = parts.embed.weight
    return w.dtype if mx.issubdtype(w.dtype, mx.floating) else parts.embed.scales.dtype


def build(target: LoadedModel, weights: dict[str, mx.array], recipe: Recipe, *, source: str = "head"
          ) -> MTPHead:
    """A head attached to ``target`` from tensors already named as the head's parameters
    (``fc.weight``, ``layers.0....``); every parameter must be present and nothing else."""
    if recipe.num_layers != 1:
        raise MTPError(f"{source}: {recipe.num_layers} MTP layers; only single-layer heads are "
                       "supported (Qwen3.5/3.6 and DeepSeek-V3 ship one)")
    parts = target_parts(target.model)
    check_parts(parts)
    weights = dict(weights)
    vocab = weights.pop("draft_vocab", None)
    if vocab is not None and (vocab.ndim != 1 or not mx.issubdtype(vocab.dtype, mx.integer)):
        raise MTPError(f"{source}: mtp.draft_vocab must be a 1-d list of token ids")
    head = MTPHead(parts, own_norm=recipe.own_norm,
                   draft_vocab=None if vocab is None else np.array(vocab))
    weights = _prepare(weights, recipe)
    if any(k.endswith(".scales") for k in weights):
        q = recipe.quantization or {}
        if "group_size" not in q or "bits" not in q:
            raise MTPError(f"{source}: quantized mtp.* tensors but no quantization settings")
        nn.quantize(head, group_size=q["group_size"], bits=q["bits"], mode=q.get("mode", "affine"),
                    class_predicate=lambda p, m: f"{p}.scales" in weights)
    expected = {k for k, _ in tree_flatten(head.parameters())}
    missing = sorted(expected - weights.keys())
    if missing:
        shown = ", ".join(f"mtp.{k}" for k in missing[:4]) + (" ..." if len(missing) > 4 else "")
        raise MTPError(f"{source}: the MTP head lacks {len(missing)} of its {len(expected)} tensors "
                       f"({shown}); converters often strip them (mlx-lm drops mtp.*): use the "
                       "original checkpoint or a conversion that keeps them")
    extra = sorted(weights.keys() - expected)
    if extra:
        raise MTPError(f"{source}: unexpected tensors for this target's head: "
                       + ", ".join(f"mtp.{k}" for k in extra[:4]))
    for k, v in tree_flatten(head.parameters()):
        if weights[k].shape != v.shape:
            raise MTPError(f"{source}: mtp.{k} has shape {tuple(weights[k].shape)}, the target's "
                           f"head needs {tuple(v.shape)}")
    dtype = _float_dtype(parts)
    head.update(tree_unflatten([(k, v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v)
                                for k, v in weights.items()]))
    if not target.quantized and any(k.endswith(".scales") for k in weights):
        from mlx_lm.utils import dequantize_model
        head = dequantize_model(head)
    head.eval()
    mx.eval(head.parameters())
    head.ready()
    return head


def load_mtp(path: Path | str, target: LoadedModel) -> MTPHead:
    """Attach the MTP head stored at ``path`` (a checkpoint directory or a standalone head file)."""
    path = Path(path).expanduser()
    if path.is_dir():
        weights, recipe = read_checkpoint(path)
    elif path.is_file() and path.suffix == ".safetensors":
        weights, recipe = read_standalone(path)
    else:
        raise MTPError(f"{path}: not a checkpoint directory or a .safetensors head")
    return build(target, weights, recipe, source=str(path))


def target_identity(target: LoadedModel) -> dict[str, Any]:
    """Which target a head was trained against: its weights file's SHA-256 (a GGUF, or every
    safetensors file of a model directory, in order; the default model's 93 MB GGUF hashes in
    ~0.2 s), else a digest of the weights in memory (random test models); and its shape."""
    parts = target_parts(target.model)
    src = Path(target.source)
    if src.is_file():
        sha = sha256_file(src)
    elif src.is_dir() and list(src.glob("*.safetensors")):
        digest = hashlib.sha256()
        for f in sorted(src.glob("*.safetensors")):
            digest.update(sha256_file(f).encode())
        sha = digest.hexdigest()
    else:
        digest = hashlib.sha256()
        for k, v in tree_flatten(target.model.parameters()):
            digest.update(k.encode())
            digest.update(np.array(v.astype(mx.float32)).tobytes())
        sha = digest.hexdigest()
    return {"name": target.name, "file": src.name if src.exists() else target.source, "sha256": sha,
            "vocab_size": parts.vocab_size, "hidden_size": parts.hidden_size,
            "num_layers": len(parts.inner.layers)}


def check_target(path: Path | str, target: LoadedModel) -> None:
    """Refuse a standalone head whose recipe names another target than ``target`` (by the
    weights' SHA-256 that ``warmspec forge`` records); heads without a recorded target pass."""
    path = Path(path)
    want = (read_recipe(path).get("target") or {}).get("sha256")
    if want is None:
        return
    got = target_identity(target)
    if got["sha256"] != want:
        named = (read_recipe(path).get("target") or {}).get("file", "?")
        raise MTPError(f"{path.name} was trained for {named} (sha256 {want[:12]}…), but the loaded "
                       f"model {target.name} ({got['file']}) has sha256 {got['sha256'][:12]}…")


def read_recipe(path: Path | str) -> dict[str, Any]:
    """The JSON recipe beside a standalone head file."""
    return _read_json(Path(path).with_suffix(".json"))


def save_mtp(head: MTPHead, path: Path | str, *, dtype: mx.Dtype | None = None, **meta: Any) -> None:
    """Write ``head`` as a standalone head: ``path`` (.safetensors, ``mtp.*`` names, the gamma in
    use, the draft vocabulary when it has one; floating tensors cast to ``dtype`` when given) and
    its recipe beside it, with the file's SHA-256; ``meta`` adds fields (e.g. what it was trained
    on)."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: a head file ends in .safetensors")
    tensors = {f"mtp.{k}": v.astype(dtype) if dtype is not None and mx.issubdtype(v.dtype, mx.floating)
               else v for k, v in tree_flatten(head.parameters())}
    if head.draft_vocab is not None:
        tensors["mtp.draft_vocab"] = mx.array(head.draft_vocab)
    mx.save_safetensors(str(path), tensors)
    recipe = {"format": FORMAT, "version": 1, "num_layers": len(head.layers), "norm_offset": 0.0,
              "hidden": "final_norm", "final_norm": "own" if "norm" in head else "target",
              "hidden_size": head.parts.hidden_size, **meta}
    if head.draft_vocab is not None:
        recipe["draft_vocab_size"] = int(head.draft_vocab.size)
    quantized = [m for _, m in head.named_modules() if isinstance(m, nn.QuantizedLinear)]
    if quantized:
        q = quantized[0]
        recipe["quantization"] = {"group_size": q.group_size, "bits": q.bits, "mode": q.mode}
    recipe["sha256"] = sha256_file(path)
    path.with_suffix(".json").write_text(json.dumps(recipe, indent=1) + "\n")
