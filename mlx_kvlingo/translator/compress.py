"""Compressing a translator: one shared low-rank projection of the source layers.

Each target layer's map reads the concatenated features of many source layers
(SmolLM2 -> Gemma 3: 18 of 30 per map), so a switch reads and multiplies the
same source features once per target layer: most of its time. Stacked side by
side over the union of the source layers they read, the maps of one kind (keys or
values) form one matrix W [source width, sum of target widths] whose useful rank
is far below its size. Its best rank-r form *for the features the source actually
produces* is a truncated SVD in the metric of their second moment S = E[x^T x]:
with S = L L^T, the error E|x (W - A B)|^2 = |L^T (W - A B)|_F^2, so the SVD of
L^T W = U s V^T gives A = L^-T U_r (the shared projection) and B = s_r V_r^T (each
layer's columns: its new map). A switch then projects every token once per kind
and each layer maps r numbers; the source features are read once, not per layer.

No retraining is needed: the compressed maps approximate the trained ones on the
calibration features (their relative error per layer is reported), and the
calibration text is not the evaluation text.

Token maps (``spec.token_layers``: each map also reads the target's embeddings of
the token and the one before it) are kept as they are, or *folded in*: the token
inputs join the source features under the projection (``fold_tokens``), and no
separate token map is left. A Qwen2.5-Coder translator with token maps on every
layer is two thirds token maps, so that is where its size goes; a SmolLM2 <->
Gemma 3 switch spends a third of its maps' multiply-adds on them. With different
tokenizers the calibration pairs each target token with the source features of
the source token it is aligned to, as a switch feeds them
(:func:`aligned_calibration_features`).
"""

from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..data.corpus import read_corpus, split_documents, token_stream, token_windows
from ..errors import KvlingoError
from ..models.cache import cache_features, prefill
from ..models.features import token_inputs
from .align import align_text
from .maps import Translator


@dataclass
class CompressionReport:
    key_rank: int
    value_rank: int
    tokens: int  # calibration positions
    # Relative squared error of each target layer's compressed map output on the
    # calibration features, |x W - x A B|^2 / |x W|^2, for keys and values.
    key_error: List[float]
    value_error: List[float]
    macs_before: int  # multiply-adds per token of the maps (source terms)
    macs_after: int


def calibration_features(source: nn.Module, windows: Sequence[Sequence[int]],
                         layers: Sequence[int], target: Optional[nn.Module] = None
                         ) -> Dict[str, np.ndarray]:
    """The source's content-space keys and values of ``layers``, concatenated in
    that order per token, over token windows (each prefilled from its start):
    {"k": [N, width], "v": [N, width]} in float64. With ``target`` (a model sharing
    the source's tokenizer), also "tokens": its token inputs of the same positions."""
    out = {"k": [], "v": [], "tokens": []}
    for w in windows:
        ids = mx.array(list(w))[None]
        cache = prefill(source, ids)
        ks, vs, _ = cache_features(source, cache, list(layers))
        out["k"].append(np.concatenate([np.array(ks[j][0]) for j in layers], axis=1))
        out["v"].append(np.concatenate([np.array(vs[j][0]) for j in layers], axis=1))
        if target is not None:
            out["tokens"].append(np.array(token_inputs(target, ids, 0, len(w))[0]))
    return {kind: np.concatenate(x).astype(np.float64) for kind, x in out.items() if x}


def aligned_calibration_features(source: nn.Module, source_tokenizer, target: nn.Module,
                                 target_tokenizer, texts: Sequence[str],
                                 layers: Sequence[int]) -> Dict[str, np.ndarray]:
    """:func:`calibration_features` for models with different tokenizers: one row per
    target token of each text (but the native prefix, which is not translated), the
    source's features of the token it is aligned to (translator.align) beside the
    target's token inputs of it."""
    out = {"k": [], "v": [], "tokens": []}
    for text in texts:
        a = align_text(source_tokenizer, target_tokenizer, text)
        index = np.asarray(a.source_index)
        keep = np.nonzero(index >= 0)[0]
        if not len(keep):
            continue
        cache = prefill(source, mx.array(a.source_tokens)[None])
        ks, vs, _ = cache_features(source, cache, list(layers))
        rows = index[keep]
        out["k"].append(np.concatenate([np.array(ks[j][0]) for j in layers], axis=1)[rows])
        out["v"].append(np.concatenate([np.array(vs[j][0]) for j in layers], axis=1)[rows])
        ids = mx.array(a.target_tokens)[None]
        out["tokens"].append(np.array(token_inputs(target, ids, 0, ids.shape[1])[0])[keep])
    if not out["k"]:
        raise KvlingoError("No calibration text has a token to translate.")
    return {kind: np.concatenate(x).astype(np.float64) for kind, x in out.items()}


def _stacked(translator: Translator, kind: str, widths: Dict[int, int],
             fold_tokens: bool = False) -> List[np.ndarray]:
    """Each target layer's map of ``kind`` as [union width, target width], zero rows
    for the source layers it does not read; with ``fold_tokens``, its token map's
    rows below them (zeros for a layer without one)."""
    union = translator.source_layers
    at, col = 0, {}
    for j in union:
        col[j], at = at, at + widths[j]
    maps = translator.k_maps if kind == "k" else translator.v_maps
    out = []
    for layers, m in zip(translator.spec.layer_map, maps):
        w = np.array(m.weight, dtype=np.float64).T
        full = np.zeros((at, w.shape[1]))
        row = 0
        for j in layers:
            full[col[j]: col[j] + widths[j]] = w[row: row + widths[j]]
            row += widths[j]
        if fold_tokens:
            tok = translator.token_map(len(out), kind)
            rows = (np.array(tok.weight, dtype=np.float64).T if tok is not None
                    else np.zeros((translator.spec.token_width, w.shape[1])))
            full = np.concatenate([full, rows])
        out.append(full)
    return out


def _expanded(translator: Translator, kind: str) -> List[np.ndarray]:
    """A compressed translator's maps of ``kind`` as each target layer's whole
    matrix [projection inputs, target width]: the shared projection times its map
    (compressing it again, to lower ranks, factors these)."""
    shared = translator.k_shared if kind == "k" else translator.v_shared
    a = np.array(shared.weight, dtype=np.float64).T
    maps = translator.k_maps if kind == "k" else translator.v_maps
    return [a @ np.array(m.weight, dtype=np.float64).T for m in maps]


def _factor(x: np.ndarray, blocks: List[np.ndarray], rank: int):
    """(A [D, r], per-block B [r, width], per-block relative error) minimising
    |x W - x A B| for W = the blocks side by side."""
    w = np.concatenate(blocks, axis=1)
    moment = x.T @ x / len(x)
    lam, q = np.linalg.eigh(moment)
    floor = max(lam.max(), 1e-30) * 1e-10  # directions the source never uses
    lam = np.maximum(lam, floor)
    u, s, vt = np.linalg.svd((q * np.sqrt(lam)).T @ w, full_matrices=False)
    rank = min(rank, len(s))
    a = (q / np.sqrt(lam)) @ u[:, :rank]
    b = s[:rank, None] * vt[:rank]
    y, yr = x @ w, (x @ a) @ b
    errors, at, parts = [], 0, []
    for blk in blocks:
        sl = slice(at, at + blk.shape[1])
        errors.append(float(((y[:, sl] - yr[:, sl]) ** 2).sum() / max((y[:, sl] ** 2).sum(),
                                                                    1e-30)))
        parts.append(b[:, sl])
        at += blk.shape[1]
    return a, parts, errors


def compress_translator(translator: Translator, features: Dict[str, np.ndarray],
                        key_rank: int, value_rank: int, fold_tokens: bool = False):
    """A compressed copy of ``translator`` (spec.shared_rank) fitted on ``features``
    (:func:`calibration_features` of its ``source_layers``, with the target's
    "tokens" when ``fold_tokens``). Token maps are kept as they are, or with
    ``fold_tokens`` folded into the projection. A compressed translator is
    compressed again (to lower ranks: a cheaper switch) from its maps as they are,
    its token maps folded in or not as they were. Returns (translator,
    CompressionReport)."""
    recompress = bool(translator.spec.shared_rank)
    if recompress and fold_tokens != bool(translator.spec.shared_tokens):
        raise KvlingoError("A compressed translator is compressed again as it was made: "
                           + ("with" if translator.spec.shared_tokens else "without")
                           + " its token maps folded in.")
    for r in (key_rank, value_rank):
        if not isinstance(r, int) or r < 1:
            raise KvlingoError(f"A rank is a count >= 1, not {r!r}.")
    if fold_tokens and not translator.spec.token_layers and not recompress:
        raise KvlingoError("This translator has no token maps to fold in.")
    if fold_tokens and "tokens" not in features:
        raise KvlingoError("Folding token maps in needs the target's token inputs "
                           "(calibration_features(..., target=...), or "
                           "aligned_calibration_features).")
    geometry = translator.spec.source.cache_geometry.layers
    widths = {j: geometry[j].width for j in translator.source_layers}
    width = sum(widths.values())
    if any(features[k].shape[1] != width for k in "kv"):
        raise KvlingoError(f"Calibration features are {features['k'].shape[1]} wide; the "
                           f"translator's source layers are {width}.")
    inputs = width + (translator.spec.token_width if fold_tokens else 0)
    if len(features["k"]) < min(max(key_rank, value_rank), inputs):
        raise KvlingoError(f"{len(features['k'])} calibration positions cannot fit rank "
                           f"{max(key_rank, value_rank)}: calibrate on more tokens.")
    factors, errors = {}, {}
    for kind, rank in (("k", key_rank), ("v", value_rank)):
        x = features[kind]
        if fold_tokens:
            x = np.concatenate([x, features["tokens"]], axis=1)
        blocks = (_expanded(translator, kind) if recompress
                  else _stacked(translator, kind, widths, fold_tokens))
        a, parts, errors[kind] = _factor(x, blocks, rank)
        factors[kind] = (a, parts)
    # The ranks as factored: no more than the stacked maps have.
    ranks = {kind: factors[kind][0].shape[1] for kind in "kv"}
    out = Translator(replace(translator.spec, shared_rank=ranks, shared_tokens=fold_tokens))
    if not fold_tokens:  # token maps kept apart stay as they are
        out.k_tok, out.v_tok = translator.k_tok, translator.v_tok
    for kind, (a, parts) in factors.items():
        shared = out.k_shared if kind == "k" else out.v_shared
        shared.weight = mx.array(a.T.astype(np.float32))
        for m, b in zip(out.k_maps if kind == "k" else out.v_maps, parts):
            m.weight = mx.array(b.T.astype(np.float32))
    mx.eval(out.parameters())
    targets = [m.weight.shape[0] for m in translator.k_maps]
    tokens = sum(2 * translator.spec.token_width * targets[i]
                 for i in translator.spec.token_layers)
    if recompress:
        before = sum(r * (inputs + sum(targets)) for r in translator.spec.shared_rank.values())
    else:
        before = sum(2 * sum(widths[j] for j in layers) * t
                     for layers, t in zip(translator.spec.layer_map, targets))
    if not (recompress and fold_tokens):  # (folded in already: counted in inputs)
        before += tokens
    after = sum(ranks[k] * (inputs + sum(targets)) for k in "kv") + (0 if fold_tokens
                                                                     else tokens)
    return out, CompressionReport(ranks["k"], ranks["v"], len(features["k"]),
                                  errors["k"], errors["v"], before, after)


def compress_on_corpus(source: nn.Module, source_tokenizer, translator: Translator,
                       key_rank: int, value_rank: int, corpus: str = "stdlib",
                       tokens: int = 8192, window: int = 512,
                       target: Optional[nn.Module] = None, target_tokenizer=None):
    """:func:`compress_translator` calibrated on ``tokens`` positions of the training
    part of ``corpus`` (data.corpus; the held-out part, which evaluations read, is
    left out), in windows of ``window`` source tokens; with ``target``, the token
    maps are folded in (a cross-tokenizer translator needs ``target_tokenizer`` too:
    each window's text is aligned). Returns (translator, report)."""
    train, _ = split_documents(read_corpus(corpus, source_tokenizer))
    stream = token_stream(source_tokenizer, train)
    count = max(tokens // window, 1)
    batches = token_windows(stream, window, 1, count)
    windows = [b[0].tolist() for b in batches]
    if target is not None and translator.cross_tokenizer:
        if target_tokenizer is None:
            raise KvlingoError("Folding a cross-tokenizer translator's token maps needs "
                               "the target's tokenizer.")
        texts = [source_tokenizer.decode(w) for w in windows]
        features = aligned_calibration_features(source, source_tokenizer, target,
                                                target_tokenizer, texts,
                                                translator.source_layers)
    else:
        features = calibration_features(source, windows, translator.source_layers, target)
    return compress_translator(translator, features, key_rank, value_rank,
                               fold_tokens=target is not None)
