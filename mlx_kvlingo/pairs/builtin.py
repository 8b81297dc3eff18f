"""Translators made on the spot, and the built-in pair as a ready Session.

Not part of a conversation: this module fits (``fit``, ``data``) so that
``chat``, ``serve`` and the examples have translators without a training run.
"""

import hashlib
from pathlib import Path
from typing import Callable, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..chat.session import Session
from ..data.corpus import split_documents, stdlib_documents
from ..errors import KvlingoError
from ..files import default_cache_dir
from ..models.geometry import cache_geometry, model_name, tokenizer_fingerprint
from ..models.load import load
from ..train.recipe import fit_translator
from ..train.samples import AlignedText, SharedTokens
from ..translator.maps import Translator, load_translator
from .toy import ASSET_DIR, STAGE2_TRANSLATOR, ensure_toy_pair

BUILTIN_NAMES = ("small", "large")


def _joined(docs) -> str:
    return "\n\n".join(text for _, text in docs)


def _weights_id(model: nn.Module) -> str:
    """Identifies a model's weights cheaply: its weight files' names, sizes and
    times when it was loaded from a directory, else a sample of its parameters."""
    from mlx.utils import tree_flatten

    h = hashlib.sha256()
    path = Path(model_name(model))
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if files:
        for f in files:
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    else:
        for k, v in tree_flatten(model.parameters()):
            h.update(k.encode())
            h.update(np.array(v.reshape(-1)[:256].astype(mx.float32)).tobytes())
    return h.hexdigest()[:16]


def stage1_translator(
    source: nn.Module,
    source_tokenizer,
    target: nn.Module,
    target_tokenizer,
    cache_dir: Optional[Union[str, Path]] = None,
    tokens: int = 10_000,
    context_len: int = 256,
    log: Optional[Callable[[str], None]] = None,
) -> Translator:
    """A stage-1 translator source -> target fitted on the standard library's
    docstrings, kept in ``<cache_dir>/translators/`` and reused while both models'
    weights and the settings stay the same. Models with different tokenizers get
    a cross-tokenizer translator (three source layers per map, aligned text)."""
    cross = tokenizer_fingerprint(source_tokenizer) != tokenizer_fingerprint(target_tokenizer)
    key = hashlib.sha256(
        f"{_weights_id(source)}:{_weights_id(target)}:{tokens}:{context_len}:1"
        f"{':cross' if cross else ''}".encode()
    ).hexdigest()[:16]
    path = Path(cache_dir or default_cache_dir()) / "translators" / f"stage1-{key}.safetensors"
    if path.is_file():
        try:
            return load_translator(path)
        except KvlingoError:
            pass  # damaged: fit again
    log = log or (lambda s: None)
    log(f"Fitting a stage-1 translator {model_name(source)} -> {model_name(target)} "
        f"on {tokens} positions of stdlib docstrings (once; kept in {path.parent}) ...")
    train_docs, heldout_docs = split_documents(stdlib_documents())
    if cross:  # three source layers per map
        per_layer = min(3, cache_geometry(source).n_layers)
        pair = AlignedText(source_tokenizer, target_tokenizer, _joined(train_docs),
                           _joined(heldout_docs))
    else:
        per_layer = 1
        stream: List[int] = []
        for _, text in train_docs:  # in name order; enough documents for `tokens` positions
            stream.extend(source_tokenizer.encode(text + "\n\n", add_special_tokens=False))
            if len(stream) >= 2 * tokens:
                break
        pair = SharedTokens(stream, [])
    translator, _ = fit_translator(source, source_tokenizer, target, target_tokenizer,
                                   "stdlib", tokens, context_len, sources_per_layer=per_layer,
                                   pair=pair, log=lambda s: None)
    translator.save(path)
    return translator


def builtin_session(
    cache_dir: Optional[Union[str, Path]] = None,
    fit_tokens: int = 10_000,
    log: Optional[Callable[[str], None]] = None,
    **session_kwargs,
) -> Session:
    """A session with the built-in pair: "small" (the qwen3 source) and "large" (the
    llama target). small -> large uses the shipped stage-2 translator (it keeps
    ~60 % of what the context is worth to large; a stage-1 fit keeps ~2 %:
    benchmarks/results/builtin-pair.md); large -> small a stage-1 translator
    fitted once and cached (a 1,000-step stage 2 kept only 4 % that way, so none
    ships: builtin-pair-reverse.md). A rebuilt pair gets stage 1 both ways."""
    src_dir, tgt_dir = ensure_toy_pair(cache_dir, log=log)
    small, small_tok = load(src_dir)
    large, large_tok = load(tgt_dir)
    session = Session({"small": (small, small_tok), "large": (large, large_tok)},
                      **session_kwargs)
    if Path(src_dir) == ASSET_DIR / "source" and STAGE2_TRANSLATOR.is_file():
        forward = load_translator(STAGE2_TRANSLATOR)
    else:
        forward = stage1_translator(small, small_tok, large, large_tok, cache_dir, fit_tokens,
                                    log=log)
    session.add_translator("small", "large", forward)
    session.add_translator("large", "small", stage1_translator(
        large, large_tok, small, small_tok, cache_dir, fit_tokens, log=log))
    return session
