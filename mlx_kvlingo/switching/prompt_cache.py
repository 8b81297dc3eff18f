"""Convert an mlx-lm prompt-cache file made for one model into one for another.

mlx-lm saves a prompt cache (``mlx_lm.cache_prompt``, ``save_prompt_cache``) as one
safetensors file: every layer's cache state, the cache classes, and metadata with
``model`` (the ``--model`` string it was made with) and ``tokenizer_config``
(JSON). ``mlx_lm.generate --prompt-cache-file`` refuses a file whose ``model``
differs from its ``--model``, and treats its ``--prompt`` as a continuation of
the cached text.

:func:`convert_prompt_cache_file` translates every cached position into the target
model's cache and writes a file whose metadata names the target, so::

    mlx_lm.cache_prompt --model SOURCE --prompt-cache-file src.safetensors --prompt "$DOC"
    mlx-kvlingo convert-cache src.safetensors --translator s2t.safetensors \\
        --source SOURCE --target TARGET --out tgt.safetensors --prompt "$DOC"
    mlx_lm.generate --model TARGET --prompt-cache-file tgt.safetensors --prompt "Summarize."

Token ids: the file does not store them (only K/V and the offset). A translator
with a native prefix (the default: the target computes the first token, the
attention sink, itself) needs the first ids, so the prompt given to
``cache_prompt`` must be given again; it is re-tokenized exactly as
``cache_prompt`` does (chat template with the prompt as an unfinished user
message, or plain encoding) and checked against the file: same length, and the
source's own keys for the first tokens equal the cached ones. Without a native
prefix the prompt is optional.
"""

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..errors import KvlingoError
from ..files import written_atomically
from ..models.cache import cache_length, prefill, read_layer
from ..models.geometry import cache_dtype, cache_geometry, model_name
from ..translator.align import NATIVE, Alignment, align_offsets, tokenize_with_offsets
from ..translator.maps import Translator
from .api import translate_cache, translate_span
from .choice import RecomputeBudget

METADATA_KEY = "mlx_kvlingo"
_CHECK_TOKENS = 8  # leading positions re-computed to check that the prompt matches


class PromptCacheError(KvlingoError):
    """A prompt-cache file is unreadable, of an unsupported kind, or does not match."""


@dataclass
class ConversionReport:
    tokens: int  # cached positions
    translated: int
    native: int  # computed by the target itself (native prefix and tail; recomputed: apart)
    seconds: float
    source_model: str  # what the input file's metadata named
    target_model: str
    dtype: str

    def to_dict(self) -> dict:
        return asdict(self)


def cache_prompt_tokens(tokenizer, prompt: str) -> List[int]:
    """The token ids ``mlx_lm.cache_prompt --prompt PROMPT`` caches with this
    tokenizer: the chat template with the prompt as an unfinished user message when
    the tokenizer has one, else the plain encoding."""
    if getattr(tokenizer, "has_chat_template", False):
        return list(tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=False,
            continue_final_message=True,
        ))
    return list(tokenizer.encode(prompt))


def cache_prompt_alignment(source_tokenizer, target_tokenizer, prompt: str):
    """An :class:`~mlx_kvlingo.translator.align.Alignment` from the tokens ``cache_prompt``
    caches for ``prompt`` with the source tokenizer to those the target's own
    tokenizer and chat template give: each target token of the prompt's text reads
    the source token holding its last character; template tokens are computed by
    the target (NATIVE)."""
    def render(tok):
        ids = cache_prompt_tokens(tok, prompt)
        if getattr(tok, "has_chat_template", False):
            text = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                           tokenize=False, add_generation_prompt=False,
                                           continue_final_message=True)
            got, offsets = tokenize_with_offsets(tok, text, add_special_tokens=False)
        else:
            text = prompt
            got, offsets = tokenize_with_offsets(tok, text)
        if list(got) != list(ids):
            raise KvlingoError("Could not locate the prompt's characters in its tokens.")
        lo = text.rfind(prompt)
        hi = lo + len(prompt)
        # Characters relative to the prompt; tokens outside it have none.
        inside = [(max(a, lo) - lo, b - lo) if a < b and lo <= b - 1 < hi else (0, 0)
                  for a, b in offsets]
        return ids, inside

    s_ids, s_off = render(source_tokenizer)
    t_ids, t_off = render(target_tokenizer)
    index = align_offsets(s_off, t_off, native_prefix=0)
    index = [NATIVE if b <= a else i for i, (a, b) in zip(index, t_off)]
    return Alignment(s_ids, t_ids, index, t_off)


def read_prompt_cache(path):
    """(cache, metadata) of an mlx-lm prompt-cache file, with clear errors."""
    from mlx_lm.models.cache import load_prompt_cache

    path = Path(path)
    if not path.is_file():
        raise PromptCacheError(f"Prompt-cache file not found: {path}")
    _check_cache_classes(path)
    try:
        cache, metadata = load_prompt_cache(str(path), return_metadata=True)
    except Exception as e:
        raise PromptCacheError(
            f"{path} is not an mlx-lm prompt-cache file ({type(e).__name__}: {e})."
        ) from e
    if not cache:
        raise PromptCacheError(f"{path} holds no layers.")
    return cache, metadata


_CACHE_CLASSES = {"KVCache", "RotatingKVCache", "QuantizedKVCache"}


def _check_cache_classes(path: Path):
    """mlx-lm instantiates the class *named in the file*: allow only plain KV caches."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    try:
        _, meta = mx.load(str(path), format="safetensors", return_metadata=True)
        classes = tree_unflatten(list(meta.items()))[1]
        names = list(classes.values()) if isinstance(classes, dict) else list(classes)
    except Exception as e:
        raise PromptCacheError(f"{path} is not an mlx-lm prompt-cache file ({e}).") from e
    bad = [n for n in names if n not in _CACHE_CLASSES]
    if bad:
        raise PromptCacheError(
            f"{path} names cache types {sorted(set(map(str, bad)))}; only "
            f"{sorted(_CACHE_CLASSES)} are accepted."
        )


def _check_source_cache(source: nn.Module, cache: List, path: str):
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

    g = cache_geometry(source)
    if len(cache) != g.n_layers:
        raise PromptCacheError(
            f"{path} has {len(cache)} layers; the source model {model_name(source)} has "
            f"{g.n_layers}. Was it made by another model?"
        )
    for i, (c, lg) in enumerate(zip(cache, g.layers)):
        if type(c) not in (KVCache, RotatingKVCache, QuantizedKVCache):
            raise PromptCacheError(
                f"{path}: layer {i} is a {type(c).__name__}; only attention KV caches "
                "can be translated."
            )
        k, _, _ = read_layer(c)
        if k is None:
            raise PromptCacheError(f"{path}: the cache is empty.")
        if k.shape[1] != lg.n_kv_heads or k.shape[3] != lg.head_dim:
            raise PromptCacheError(
                f"{path}: layer {i} holds {k.shape[1]} KV heads of {k.shape[3]}; the source "
                f"model has {lg.n_kv_heads} of {lg.head_dim}. Was it made by another model?"
            )
    if len({c.offset for c in cache}) != 1:
        raise PromptCacheError(f"{path}: layers hold different numbers of tokens.")


def _check_prompt(source: nn.Module, cache: List, tokens: Sequence[int]):
    """The source's keys for the first tokens must equal the cached ones."""
    n = min(_CHECK_TOKENS, len(tokens))
    own = prefill(source, mx.array(tokens[:n])[None])
    worst = 0.0
    for c_file, c_own in zip(cache, own):
        kf, _, start = read_layer(c_file)
        if start > 0:  # a sliding layer that has dropped its first tokens
            continue
        ko, _, _ = read_layer(c_own)
        kf = kf[..., :n, :].astype(mx.float32)
        ko = ko.astype(mx.float32)
        err = (mx.abs(kf - ko).max() / (mx.abs(ko).max() + 1e-6)).item()
        worst = max(worst, err)
    if worst > 0.05:
        raise PromptCacheError(
            "The prompt does not match the cached text: the source's keys for its first "
            f"{n} tokens differ from the file's (relative error {worst:.2f}). Give the "
            "exact prompt that was cached, and the model that cached it as --source."
        )


def native_dtype(path_or_repo: str) -> mx.Dtype:
    """The K/V dtype mlx-lm gives a model it loads itself (no casting), read lazily."""
    from mlx_lm.utils import _download, load_model

    try:
        model, _ = load_model(_download(str(path_or_repo)), lazy=True)
    except Exception as e:
        raise KvlingoError(f"Could not read the model at {path_or_repo}: {e}") from e
    return cache_dtype(model)


def convert_prompt_cache(
    source: nn.Module,
    target: nn.Module,
    translator: Translator,
    cache: List,
    tokens: Optional[Sequence[int]] = None,
    dtype: Optional[mx.Dtype] = None,
    alignment=None,
    prompt: Optional[str] = None,
    tokenizer=None,
) -> List:
    """A target prompt cache holding every position of the source prompt cache
    ``cache``: the switch a :func:`~.api.switch` makes, with the translator's
    defaults (its native prefix and tail computed by the target from ``tokens``,
    the cached token ids; its recompute), read to the end (api.translate_cache).
    ``dtype``: cast the result (default: the target's dtype).

    ``alignment``: for a cross-tokenizer translator, source -> target tokens of
    the cached text (:func:`cache_prompt_alignment`); the result holds the target's
    own tokenization of it. ``prompt``: the cached text, where the fact-like words
    are found (with ``tokenizer``, the target's, for a shared tokenizer)."""
    from mlx_lm.models.cache import make_prompt_cache

    n = cache_length(cache)
    if translator.cross_tokenizer or alignment is not None:
        if alignment is None:
            raise KvlingoError(
                "A cross-tokenizer translator needs the prompt that was cached (to "
                "tokenize it for the target too)."
            )
        if len(alignment.source_tokens) != n:
            raise PromptCacheError(
                f"The prompt is {len(alignment.source_tokens)} tokens but the cache holds "
                f"{n}: it is not the prompt that was cached."
            )
        text = (prompt, alignment.target_offsets) if prompt is not None and \
            alignment.target_offsets is not None else None
        out = translate_cache(source, target, translator, cache,
                              length=len(alignment.target_tokens), alignment=alignment,
                              text=text)
        return _finish(out, dtype)
    if tokens is None:
        needs = _needs_ids(translator, n)
        if needs:
            raise KvlingoError(f"The translator {needs}: give the prompt that was cached.")
        out = translate_span(source, target, translator, cache, make_prompt_cache(target),
                             mx.array([0] * n)[None], n)  # ids are not read
        return _finish(out, dtype)
    if len(tokens) != n:
        raise PromptCacheError(
            f"The prompt is {len(tokens)} tokens but the cache holds {n}: it is not the "
            "prompt that was cached (or it was cached with another tokenizer or template)."
        )
    out = translate_cache(source, target, translator, cache, list(tokens), length=n,
                          tokenizer=tokenizer)
    return _finish(out, dtype)


def _needs_ids(translator: Translator, n: int) -> str:
    """Why converting an n-position cache needs its token ids ('' when it does not)."""
    spec = translator.spec
    if min(spec.native_prefix, n):
        return f"computes the first {min(spec.native_prefix, n)} token(s) natively"
    if getattr(spec, "native_layer0", False):
        return "computes layer 0 natively from the token ids"
    if getattr(spec, "token_layers", None):
        return "maps read the target's token embeddings"
    if spec.native_tail or RecomputeBudget.of(translator).positions(n):
        return "computes its native tail and recomputes positions itself"
    return ""


def _finish(out: List, dtype) -> List:
    if dtype is not None:
        for c in out:
            c.keys, c.values = c.keys.astype(dtype), c.values.astype(dtype)
    mx.eval([(c.keys, c.values) for c in out])
    return out


def convert_prompt_cache_file(
    in_path,
    out_path,
    source: nn.Module,
    target: nn.Module,
    translator: Translator,
    target_name: str,
    tokenizer=None,
    prompt: Optional[str] = None,
    dtype: Optional[mx.Dtype] = None,
    source_tokenizer=None,
) -> ConversionReport:
    """Convert the mlx-lm prompt-cache file ``in_path`` (made by ``source``) into
    ``out_path`` for ``target``. ``target_name`` goes into the metadata's ``model``
    and must be the exact ``--model`` string ``mlx_lm.generate`` will be given.
    ``prompt`` (with ``tokenizer``): the text given to ``mlx_lm.cache_prompt``.
    With a cross-tokenizer translator, ``tokenizer`` is the target's and
    ``source_tokenizer`` the source's, and the prompt is required."""
    from mlx_lm.models.cache import save_prompt_cache

    t0 = time.perf_counter()
    in_path, out_path = Path(in_path), Path(out_path)
    cache, metadata = read_prompt_cache(in_path)
    _check_source_cache(source, cache, str(in_path))
    n = cache_length(cache)
    tokens = alignment = None
    if translator.cross_tokenizer:
        if prompt is None or tokenizer is None or source_tokenizer is None:
            raise KvlingoError(
                "A cross-tokenizer translator needs the prompt that was cached and both "
                "tokenizers (it re-tokenizes the prompt for the target).")
        alignment = cache_prompt_alignment(source_tokenizer, tokenizer, prompt)
        if len(alignment.source_tokens) != n:
            raise PromptCacheError(
                f"The prompt is {len(alignment.source_tokens)} tokens but {in_path} holds "
                f"{n}: it is not the prompt that was cached.")
        _check_prompt(source, cache, alignment.source_tokens)
    elif prompt is not None:
        if tokenizer is None:
            raise KvlingoError("A tokenizer is needed to re-tokenize the prompt.")
        tokens = cache_prompt_tokens(tokenizer, prompt)
        if len(tokens) != n:
            raise PromptCacheError(
                f"The prompt is {len(tokens)} tokens but {in_path} holds {n}: it is not "
                "the prompt that was cached (or it was cached with another tokenizer or "
                "template)."
            )
        _check_prompt(source, cache, tokens)
    out = convert_prompt_cache(source, target, translator, cache, tokens, dtype, alignment,
                               prompt, tokenizer)
    meta = {k: v for k, v in metadata.items() if k != METADATA_KEY}
    source_model = meta.get("model", "")
    meta["model"] = str(target_name)
    meta.setdefault("tokenizer_config", "{}")  # mlx_lm.generate reads it
    tail = translator.spec.native_tail
    if alignment is not None:
        index = alignment.with_native_prefix(translator.spec.native_prefix).source_index
        n = len(index)
        native = sum(1 for i in index[:max(n - tail, 0)] if i < 0) + min(tail, n)
    else:
        native = min(translator.spec.native_prefix + tail, n)
    meta[METADATA_KEY] = json.dumps({
        "converted_from": source_model,
        "translator": f"{translator.spec.source.name} -> {translator.spec.target.name}",
        "native": native,
        "native_tail": tail,
        "tokens": n,
    })
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with written_atomically(out_path, ".safetensors") as tmp:
        save_prompt_cache(str(tmp), out, meta)
    return ConversionReport(
        tokens=n, translated=n - native, native=native,
        seconds=time.perf_counter() - t0, source_model=source_model,
        target_model=str(target_name), dtype=str(out[0].keys.dtype).replace("mlx.core.", ""),
    )
