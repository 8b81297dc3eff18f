"""Stage 1: closed-form least-squares maps from streamed float64 moments.

For target layer i and K (likewise V), with X the concatenated content-space
features of the source layers ``layer_map[i]`` and Y the target's, the map W
minimises |Y - X Wᵀ|² + λ |W|². It only needs XᵀX and YᵀX, summed over any number
of token positions, so memory does not grow with the corpus.
"""

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..errors import KvlingoError
from ..models.features import token_features
from ..translator.maps import Translator, TranslatorSpec
from . import distributed


@dataclass
class Moments:
    """Running sums for one least-squares problem Y ≈ X Wᵀ."""

    xtx: np.ndarray
    ytx: np.ndarray
    y_sum: np.ndarray
    y_sq: np.ndarray  # per output column
    count: int = 0

    @classmethod
    def zeros(cls, d_in: int, d_out: int) -> "Moments":
        return cls(
            np.zeros((d_in, d_in)), np.zeros((d_out, d_in)), np.zeros(d_out), np.zeros(d_out)
        )


@dataclass
class FitReport:
    tokens: int = 0
    seconds: float = 0.0
    r2_keys: List[float] = field(default_factory=list)
    r2_values: List[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "seconds": round(self.seconds, 2),
            "r2_keys": [round(r, 4) for r in self.r2_keys],
            "r2_values": [round(r, 4) for r in self.r2_values],
            "mean_r2_keys": round(float(np.mean(self.r2_keys)), 4),
            "mean_r2_values": round(float(np.mean(self.r2_values)), 4),
        }


def ridge_solve(xtx: np.ndarray, m: Moments, ridge: float, cols=None):
    """The ridge least-squares map W (Y ≈ X Wᵀ) from moments, and its R² on them.

    ``ridge`` is relative to the mean eigenvalue of XᵀX, so one value suits features
    of any scale. ``cols``: use only these input columns (a sub-block of XᵀX).
    """
    ytx = m.ytx
    if cols is not None:
        xtx, ytx = xtx[np.ix_(cols, cols)], ytx[:, cols]
    lam = ridge * np.trace(xtx) / len(xtx)
    w = np.linalg.solve(xtx + lam * np.eye(len(xtx)), ytx.T).T
    sse = m.y_sq.sum() - 2 * np.sum(w * ytx) + np.sum((w @ xtx) * w)
    sst = m.y_sq.sum() - np.sum(m.y_sum**2) / max(m.count, 1)
    return w, (float(1 - sse / sst) if sst > 0 else 0.0)


class MomentAccumulator:
    """Streams (source, target) feature batches into the moments of every map.

    XᵀX depends only on which source layers feed a map, so it is kept once per
    distinct input set and shared by the maps that read it.
    """

    def __init__(self, translator: Translator):
        self.translator = translator
        self.layer_map = [tuple(m) for m in translator.spec.layer_map]
        self.xtx: Dict[Tuple[int, ...], Dict[str, np.ndarray]] = {}
        self.outputs: List[Dict[str, Moments]] = []
        for i, layers in enumerate(self.layer_map):
            d_in = translator.k_maps[i].weight.shape[1]
            d_out = translator.k_maps[i].weight.shape[0]
            self.outputs.append({kind: Moments.zeros(d_in, d_out) for kind in "kv"})
            self.xtx.setdefault(layers, {kind: np.zeros((d_in, d_in)) for kind in "kv"})
        self.count = 0

    def add(self, src_k, src_v, tgt_k, tgt_v, skip: int = 0, tokens=None):
        """Add features ([B, T, width] per layer) of positions skip.. of every row
        (``tokens``: not read; token maps are fitted by :class:`GramAccumulator`)."""

        def rows(x):
            x = np.asarray(x[:, skip:].astype(mx.float32), dtype=np.float64)
            return x.reshape(-1, x.shape[-1])

        src = {"k": src_k, "v": src_v}
        tgt = {"k": tgt_k, "v": tgt_v}
        inputs = {}
        for layers, sums in self.xtx.items():
            for kind in "kv":
                x = np.concatenate([rows(src[kind][j]) for j in layers], axis=1)
                inputs[layers, kind] = x
                sums[kind] += x.T @ x
        for i, layers in enumerate(self.layer_map):
            for kind in "kv":
                x, y = inputs[layers, kind], rows(tgt[kind][i])
                m = self.outputs[i][kind]
                m.ytx += y.T @ x
                m.y_sum += y.sum(0)
                m.y_sq += (y * y).sum(0)
                m.count += len(y)
        self.count += len(next(iter(inputs.values())))

    def solve(self, ridge: float = 1e-3) -> List[float]:
        """Write the least-squares maps into the translator; return R² per map
        (keys of every layer, then values of every layer).

        ``ridge`` is relative to the mean eigenvalue of XᵀX, so one value suits
        features of any scale.
        """
        r2 = {"k": [], "v": []}
        for i, layers in enumerate(self.layer_map):
            for kind in "kv":
                w, r = ridge_solve(self.xtx[layers][kind], self.outputs[i][kind], ridge)
                r2[kind].append(r)
                maps = self.translator.k_maps if kind == "k" else self.translator.v_maps
                maps[i].weight = mx.array(w.astype(np.float32))
        mx.eval(self.translator.parameters())
        return r2["k"], r2["v"]


def fit_stage1(
    source,
    target,
    translator: Translator,
    batches: Iterable[mx.array],
    ridge: float = 1e-3,
    progress: Optional[Callable[[int], None]] = None,
    group=None,
) -> FitReport:
    """Fit every map of ``translator`` in closed form on token batches [B, T] that both
    models read identically (a shared tokenizer).

    Positions the target computes natively at switch time (the first
    ``native_prefix`` of each window) are left out of the fit. ``group``: see
    :func:`fit_features`.
    """
    skip = translator.spec.native_prefix

    def features():
        for tokens in batches:
            src_k, src_v, _ = token_features(source, tokens, translator.source_layers)
            tgt_k, tgt_v, _ = token_features(target, tokens)
            yield src_k, src_v, tgt_k, tgt_v

    return fit_features(translator, features(), ridge, progress, skip, group)


def accumulate_features(acc, features, skip: int, progress, group):
    """Add every (source K, source V, target K, target V) batch of ``features`` to
    ``acc`` (reporting positions to ``progress``), then sum it over ``group``'s ranks."""
    for item in features:  # (source K, source V, target K, target V[, token inputs])
        before = acc.count
        acc.add(*item[:4], skip=skip, tokens=item[4] if len(item) > 4 else None)
        if progress is not None:
            progress(acc.count - before)
    if group is not None:
        distributed.all_sum_moments(acc, group)
    return acc


def fit_features(
    translator: Translator,
    features: Iterable,
    ridge: float = 1e-3,
    progress: Optional[Callable[[int], None]] = None,
    skip: int = 0,
    group=None,
) -> FitReport:
    """Fit from an iterable of (source K, source V, target K, target V) feature lists
    ([B, T, width] per layer, position-aligned); positions < ``skip`` are left out.

    ``group`` (an ``mx.distributed`` group, see distributed.py): ``features`` is this
    rank's share; the moments are summed over ranks before the one solve."""
    if translator.spec.token_layers:
        raise KvlingoError("Token maps are fitted with the source layers chosen from data "
                           "(fit_selected; --select-layers).")
    t0 = time.perf_counter()
    acc = accumulate_features(MomentAccumulator(translator), features, skip, progress, group)
    report = FitReport(tokens=acc.count)
    report.r2_keys, report.r2_values = acc.solve(ridge)
    report.seconds = time.perf_counter() - t0
    translator.spec.training = {
        "stage": 1,
        "method": "least squares",
        "ridge": ridge,
        "fit": report.to_dict(),
    }
    return report


# ---------------------------------------------------------------------------
# Choosing each map's source layers from data


class GramAccumulator:
    """Moments of *all* source layers at once: one XᵀX over the concatenation of
    every source layer's features (per K and V), and YᵀX for every target layer.

    Any subset of source layers is a sub-block, so the fit of every candidate layer
    set — single layers to rank them, the top-k to use them — comes from one pass
    over the data.

    XᵀX is symmetric: :meth:`add` computes its upper block triangle alone (blocks
    of ``block`` columns: a little over half the products of the full Gram, which
    was a third of a store step) and :meth:`gram` mirrors it before a solve.
    """

    block = 512  # columns per Gram block

    def __init__(self, source_widths: List[int], target_widths: List[int],
                 token_width: int = 0):
        # With ``token_width``, the target's token inputs (models.token_inputs) are
        # one more block of columns after the source layers, read by token maps.
        self.n_source = len(source_widths)
        self.widths = list(source_widths) + ([token_width] if token_width else [])
        self.offsets = np.concatenate([[0], np.cumsum(self.widths)]).astype(int)
        total = int(self.offsets[-1])
        self.xtx = {kind: np.zeros((total, total)) for kind in "kv"}
        self.outputs = [{kind: Moments.zeros(total, d) for kind in "kv"} for d in target_widths]
        self.count = 0

    def columns(self, layers) -> np.ndarray:
        return np.concatenate([np.arange(self.offsets[j], self.offsets[j + 1]) for j in layers])

    def add(self, src_k, src_v, tgt_k, tgt_v, skip: int = 0, tokens=None):
        """Add features ([B, T, width] per layer) of positions skip.. of every row
        (``tokens``: the target's token inputs of the same positions, when the
        accumulator has their columns).

        Each batch's products are computed in float32 with MLX (this Gram is several
        thousand columns wide: float64 numpy took minutes per 1k rows) and summed
        into the float64 totals, so rounding does not grow with the corpus.
        """

        def rows(x):
            x = x[:, skip:].astype(mx.float32)
            return x.reshape(-1, x.shape[-1])

        def f64(a):
            return np.asarray(a, dtype=np.float64)

        if (tokens is not None) != (len(self.widths) > self.n_source):
            raise ValueError("token inputs must be given exactly when the fit has token columns")
        extra = [tokens] if tokens is not None else []
        for kind, src, tgt in (("k", src_k, tgt_k), ("v", src_v, tgt_v)):
            x = mx.concatenate([rows(f) for f in list(src) + extra], axis=1)
            self._add_upper(self.xtx[kind], x)
            ys = [rows(y) for y in tgt]
            for i, y in enumerate(ys):
                m = self.outputs[i][kind]
                m.ytx += f64(y.T @ x)
                m.y_sum += f64(y.astype(mx.float32).sum(0))
                m.y_sq += f64((y * y).sum(0))
                m.count += y.shape[0]
        self.count += x.shape[0]

    def _edges(self, n: int) -> List[int]:
        return list(range(0, n, self.block)) + [n]

    def _add_upper(self, total: np.ndarray, x: mx.array):
        """``total`` += the upper block triangle of xᵀx (block rows a..b, columns a..)."""
        edges = self._edges(x.shape[1])
        for a, b in zip(edges[:-1], edges[1:]):
            total[a:b, a:] += np.asarray(x[:, a:b].T @ x[:, a:], dtype=np.float64)

    def gram(self, kind: str) -> np.ndarray:
        """XᵀX for ``kind`` ("k" or "v"): the accumulated upper block triangle,
        mirrored into the lower one in place (after every add and any sum over
        ranks, only the upper triangle is current)."""
        xtx = self.xtx[kind]
        edges = self._edges(len(xtx))
        for a, b in zip(edges[:-1], edges[1:]):
            xtx[b:, a:b] = xtx[a:b, b:].T
        return xtx

    def single_layer_r2(self, i: int, ridge: float, grams=None) -> np.ndarray:
        """[n_source_layers]: mean of the K and V R² of target layer i's map from each
        source layer alone. ``grams``: {kind: :meth:`gram`}, when the caller has them."""
        grams = grams or {kind: self.gram(kind) for kind in "kv"}
        out = np.zeros(self.n_source)
        for j in range(self.n_source):
            cols = self.columns([j])
            out[j] = np.mean([ridge_solve(grams[kind], self.outputs[i][kind], ridge, cols)[1]
                              for kind in "kv"])
        return out

    def ranked_layers(self, ridge: float) -> List[List[int]]:
        """Per target layer, source layers from best to worst single-layer R²."""
        grams = {kind: self.gram(kind) for kind in "kv"}
        return [list(np.argsort(-self.single_layer_r2(i, ridge, grams)))
                for i in range(len(self.outputs))]

    def translator(self, spec: TranslatorSpec, layer_map: List[List[int]],
                   ridge: float) -> Tuple[Translator, FitReport]:
        """A translator whose map for target layer i reads source layers
        ``layer_map[i]``, solved in closed form from the shared moments."""
        t = Translator(replace(spec, layer_map=[sorted(int(j) for j in m) for m in layer_map],
                               training={}))
        if t.spec.token_layers and len(self.widths) == self.n_source:
            raise ValueError("token maps need an accumulator with token columns")
        report = FitReport(tokens=self.count)
        grams = {kind: self.gram(kind) for kind in "kv"}
        for i, layers in enumerate(t.spec.layer_map):
            cols = self.columns(layers)
            n = len(cols)
            if i in t.spec.token_layers:  # fitted jointly with the source terms
                cols = np.concatenate([cols, self.columns([self.n_source])])
            for kind, maps, r2 in (("k", t.k_maps, report.r2_keys), ("v", t.v_maps, report.r2_values)):
                w, r = ridge_solve(grams[kind], self.outputs[i][kind], ridge, cols)
                maps[i].weight = mx.array(w[:, :n].astype(np.float32))
                if len(cols) > n:
                    t.token_map(i, kind).weight = mx.array(w[:, n:].astype(np.float32))
                r2.append(r)
        mx.eval(t.parameters())
        t.spec.training = {"stage": 1, "method": "least squares", "ridge": ridge,
                           "fit": report.to_dict()}
        return t, report


def fit_selected(
    translator: Translator,
    features: Iterable,
    candidates: List[int],
    ridge: float = 1e-3,
    choose: Optional[Callable[[List[Translator]], int]] = None,
    progress: Optional[Callable[[int], None]] = None,
    skip: int = 0,
    extra: Optional[Dict[str, List[List[int]]]] = None,
    group=None,
) -> Tuple[Translator, FitReport, Dict[str, Translator]]:
    """Stage 1 with each map's source layers chosen from data.

    ``features`` yields (source K, source V, target K, target V) with *every* source
    layer. Layers are ranked per target layer by single-layer R² (K and V
    together); for each k in ``candidates`` the top-k layers are fitted from the
    same moments, and ``choose`` (e.g. held-out KL) picks one — R² itself does not
    predict how much of the context a translation keeps. ``translator`` supplies the
    pair's identity and settings; its layer map is replaced. ``extra``: more layer
    maps to fit from the same moments (e.g. adjacent layers, for comparison).
    ``group``: as in :func:`fit_features` (``choose`` must then give the same
    answer on every rank).

    Returns (chosen translator, its report, every fitted translator by name).
    """
    t0 = time.perf_counter()
    geo_s = translator.spec.source.cache_geometry.layers
    geo_t = translator.spec.target.cache_geometry.layers
    spec = translator.spec
    acc = accumulate_features(GramAccumulator([g.width for g in geo_s], [g.width for g in geo_t],
                                      spec.token_width if spec.token_layers else 0),
                      features, skip, progress, group)
    ranked = acc.ranked_layers(ridge)
    fitted = {}
    for k in candidates:
        t, report = acc.translator(translator.spec, [r[:k] for r in ranked], ridge)
        t.spec.training.update(method="least squares, source layers chosen by single-layer R2",
                               sources_per_layer=k)
        fitted[f"top{k}"] = (t, report)
    for name, layer_map in (extra or {}).items():
        fitted[name] = acc.translator(translator.spec, layer_map, ridge)
    names = [f"top{k}" for k in candidates]
    best = choose([fitted[n][0] for n in names]) if choose and len(names) > 1 else 0
    t, report = fitted[names[best]]
    report.seconds = time.perf_counter() - t0
    t.spec.training["fit"] = report.to_dict()
    t.spec.training["candidates"] = list(candidates)
    return t, report, {n: f[0] for n, f in fitted.items()}


# ---------------------------------------------------------------------------
# Value maps fitted against attention


class AttentionValueAccumulator:
    """Moments for value maps fitted to what attention does with the values.

    A value map matters only through the attention outputs it feeds: with A the
    target's own attention (averaged over query heads) from every query of a window
    to its translated positions, the map minimises |A (X Wᵀ - V)|² instead of
    |X Wᵀ - V|², so W = (XᵀAᵀAX + λI)⁻¹ XᵀAᵀAV, still closed form (the KV-compaction
    "Attention Matching" work solves values this way). The pooled rows AX and AV are
    one per query; their moments are summed like any least-squares problem's. One
    Gram per target layer (A differs per layer), so mind the width of the inputs.
    """

    def __init__(self, layer_map: List[List[int]], widths: Tuple[List[int], List[int]]):
        source_widths, target_widths = widths
        self.layer_map = [list(m) for m in layer_map]
        self.moments = []
        self.xtx = []
        for i, layers in enumerate(self.layer_map):
            d_in = sum(source_widths[j] for j in layers)
            self.moments.append(Moments.zeros(d_in, target_widths[i]))
            self.xtx.append(np.zeros((d_in, d_in)))
        self.count = 0

    @classmethod
    def for_translator(cls, translator: Translator) -> "AttentionValueAccumulator":
        geo_s = translator.spec.source.cache_geometry.layers
        geo_t = translator.spec.target.cache_geometry.layers
        return cls(translator.spec.layer_map, ([g.width for g in geo_s], [g.width for g in geo_t]))

    def add(self, src_v, tgt_v, weights):
        """Source value features (per source layer, [B, n, width]; None for layers no
        map reads), target values (per target layer, [B, n, width]) of the same n
        translated positions, and per target layer the attention [B, queries, n]
        from the window's queries to those positions."""

        def f64(a):
            return np.asarray(a, dtype=np.float64)

        for i, layers in enumerate(self.layer_map):
            x = mx.concatenate([src_v[j].astype(mx.float32) for j in layers], axis=-1)
            a = weights[i].astype(mx.float32)
            p = (a @ x).reshape(-1, x.shape[-1])  # attention-pooled features, one row per query
            r = (a @ tgt_v[i].astype(mx.float32)).reshape(-1, tgt_v[i].shape[-1])
            m = self.moments[i]
            self.xtx[i] += f64(p.T @ p)
            m.ytx += f64(r.T @ p)
            m.y_sum += f64(r.sum(0))
            m.y_sq += f64((r * r).sum(0))
            m.count += r.shape[0]
        self.count += int(weights[0].shape[0] * weights[0].shape[1])

    def solve(self, ridge: float = 1e-3) -> List[Tuple[np.ndarray, float]]:
        """Per target layer (W, R² of the attention outputs)."""
        return [ridge_solve(xtx, m, ridge) for xtx, m in zip(self.xtx, self.moments)]

    def solve_into(self, translator: Translator, ridge: float = 1e-3) -> List[float]:
        """Replace ``translator``'s value maps; return their R² per layer."""
        r2 = []
        for vm, (w, r) in zip(translator.v_maps, self.solve(ridge)):
            vm.weight = mx.array(w.astype(np.float32))
            r2.append(r)
        mx.eval(translator.parameters())
        return r2
