"""Stage 1 as one call: the recipe the ``fit`` and ``train`` commands, the built-in
pair and translators made on the spot all use.

A translator for the pair is laid out (one map per target layer, reading
``sources_per_layer`` adjacent source layers, or the best-ranked ones chosen
from data with ``select_layers``; token maps on ``token_layers``), its features
are streamed from the corpus (windows of a shared token stream, or
character-aligned text for different tokenizers) and every map is solved in
closed form (:mod:`.fit`).
"""

import contextlib
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from ..data import corpus as data
from ..errors import KvlingoError
from ..measure.evaluate import evaluate_pair
from ..models.features import token_features, token_inputs
from ..models.geometry import cache_geometry
from ..translator.maps import Translator
from . import distributed
from .fit import fit_features, fit_selected
from .samples import pair_data


class _NoProgress:
    def update(self, n: int):
        pass


@contextlib.contextmanager
def no_progress(total: int, label: str):
    yield _NoProgress()


def resolve_token_layers(text: str, target) -> List[int]:
    """Target layers whose maps also read the target's token embeddings:
    'full' (the full-attention layers), 'all', comma-separated layers, or ''."""
    text = (text or "").strip()
    layers = cache_geometry(target).layers
    if not text:
        return []
    if text == "all":
        return list(range(len(layers)))
    if text == "full":
        return [i for i, lg in enumerate(layers) if not lg.window]
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(0 <= v < len(layers) for v in values):
        raise KvlingoError(
            f"--token-layers takes 'full', 'all' or target layers in 0..{len(layers) - 1}, "
            f"got {text!r}.")
    return sorted(set(values))


def fit_translator(
    src, src_tok, tgt, tgt_tok, corpus: str = "stdlib", tokens: int = 200_000,
    context_len: int = 256, batch_size: int = 8, ridge: float = 1e-3,
    sources_per_layer: int = 1, native_prefix: int = 1,
    select_layers: Optional[Sequence[int]] = None, candidates_beside=None,
    group=None, pair=None, from_store=None, token_layers: str = "",
    progress: Callable = no_progress, log: Callable[[str], None] = print,
):
    """Stage 1; returns (translator, report).

    ``select_layers``: candidate numbers of source layers per map; each map then
    reads its best-ranked source layers (single-layer R²) and the candidate with
    the lowest held-out KL is kept. None: ``sources_per_layer`` adjacent layers.
    ``group`` (under mlx.launch): each rank fits on its share of the windows, the
    moments are summed, and every rank ends with rank 0's maps. ``pair``: the
    corpus's samples when already read (default: read ``corpus``). ``from_store``:
    called with the new translator, gives the fit's features from stage 2's feature
    store as it builds (``loop.store_fit_features``) instead of windows of its own.
    ``candidates_beside``: a path; every candidate of ``select_layers`` is saved
    beside it. ``progress(total, label)``: a context manager giving an object whose
    ``update(n)`` is called as positions are read (``typer.progressbar`` fits).
    """
    translator = Translator.for_models(
        src, tgt, src_tok, tgt_tok, sources_per_layer=sources_per_layer,
        native_prefix=native_prefix, token_layers=resolve_token_layers(token_layers, tgt),
    )
    pair = pair or pair_data(corpus, src_tok, tgt_tok)
    windows = max(tokens // context_len, 1)
    total = windows * (context_len - native_prefix) // distributed.size(group)
    label = "Fitting (stage 1" + (", cross-tokenizer)" if translator.cross_tokenizer else ")")
    all_layers = list(range(len(translator.spec.source.cache_geometry.layers)))

    def shared_features(layers):
        for tokens in distributed.shard_iter(
                data.token_windows(pair.train_stream, context_len, batch_size, windows), group):
            sk, sv, _ = token_features(src, tokens, layers)
            tk, tv, _ = token_features(tgt, tokens)
            if translator.spec.token_layers:
                yield sk, sv, tk, tv, token_inputs(tgt, tokens, 0, tokens.shape[1])
            else:
                yield sk, sv, tk, tv

    def choose(candidates):
        """Index of the candidate with the lowest KL on a few held-out windows
        (rank 0 decides for every rank)."""
        if not distributed.is_writer(group):
            return distributed.broadcast_json(None, group)
        items = pair.heldout(min(context_len, 512), 48, 8)
        rows = evaluate_pair(pair, src, tgt, candidates, items, min(context_len, 512))
        for t, r in zip(candidates, rows):
            log(f"  {t.spec.training['sources_per_layer']} source layers per map: "
                f"held-out KL {r.kl:.4f}, CBR {r.cbr:.1%}")
        return distributed.broadcast_json(min(range(len(rows)), key=lambda i: rows[i].kl), group)

    def fit_input(layers):
        """(features of ``layers`` and every target layer, positions to skip)."""
        if from_store is not None:  # cut past the native prefix already
            return from_store(translator), 0
        if not pair.aligned:
            return shared_features(layers), native_prefix
        return pair.fit_features(src, tgt, translator, windows, context_len, layers=layers,
                                 group=group), 0

    with progress(total, label) as bar:
        if select_layers:
            features, skip = fit_input(all_layers)
            extra = {f"adjacent{sources_per_layer}": translator.spec.layer_map}
            translator, report, fitted = fit_selected(translator, features, select_layers, ridge,
                                                      choose, bar.update, skip, extra, group)
        else:
            features, skip = fit_input(translator.source_layers)
            report = fit_features(translator, features, ridge=ridge, progress=bar.update,
                                  skip=skip, group=group)
    # The same moments give the same maps; sending rank 0's makes it exact even
    # across machines whose linear algebra rounds differently.
    distributed.broadcast_module(translator, group)
    translator.spec.training["corpus"] = corpus
    if select_layers and candidates_beside is not None and distributed.is_writer(group):
        for name, t in fitted.items():  # every candidate, for comparisons
            t.spec.training["corpus"] = corpus
            out = Path(candidates_beside)
            t.save(out.with_name(f"{out.stem}.stage1-{name}.safetensors"))
    return translator, report
