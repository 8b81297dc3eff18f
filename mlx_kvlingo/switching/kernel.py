"""The translation kernel: the source's cache, through the maps, into target caches.

A context's positions come in *runs*: native runs (the attention sink, a native
tail, tokens with no source counterpart) are computed by the target itself, in
order; translated runs are read from the source's cache, mapped and written.

For a fresh cache (a switch) the translation is written a layer's keys or values
at a time straight into the cache's buffers, with the rotations and layout copies
on a second CPU stream beside the map matmuls (:func:`_translate_fresh`);
extending a live cache (a conversation's spans) takes the general path through
``models.cache.build_cache``.
"""

import contextlib
import time
from dataclasses import dataclass, field
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from ..errors import KvlingoError
from ..models.cache import (
    append_layer,
    build_cache,
    cache_features,
    cache_rows,
    cache_length,
    prefill,
    read_layer,
    set_layer,
)
from ..models.features import layer0_features, layer0_kv, token_inputs
from ..models.geometry import cache_dtype, cache_geometry, max_positions
from ..models.rope import RopeTables, rerope, rope_planes, rotate_planes, unrope


@dataclass
class History:
    """Rows a switch's sliding-window layers do not keep, translated for the
    deferred recompute that reads them (switching.recompute).

    A switch keeps only the last window of a sliding layer: decoding never looks
    further back. But a recomputed span older than the window, recomputed in those
    layers with nothing before it, loses the context that made its rows what they
    are (Gemma 3 at 1,100 tokens: identifiers recalled 6 of 12 with the switch,
    11 of 12 with the target's own rows there). ``since``: the oldest recomputed
    position; each sliding layer gets the rows from its window before ``since`` up
    to its first kept row. ``layers``: layer -> (first position, keys, values) in
    cache layout, filled by the kernel: a switch translates them; a conversation's
    catch-up, which extends a live cache run by run, keeps each run's rows as it
    writes them (:meth:`record`, :meth:`record_mapped`), from the rows its cache
    still held before it (rows older than those are gone: not kept)."""

    since: int
    layers: dict = field(default_factory=dict)

    def reach(self, window: int) -> int:
        """The oldest position a recompute from ``since`` reads in a layer with this
        sliding window."""
        return max(self.since - window + 1, 0)

    def add(self, layer: int, lo: int, keys: mx.array, values: mx.array):
        """Rows of positions lo.. (cache layout) for ``layer``, after the rows it has
        before lo; rows that do not reach lo are dropped (the rows must run on
        without a gap)."""
        held = self.layers.get(layer)
        if held is not None and held[0] <= lo <= held[0] + held[1].shape[2]:
            first, k, v = held
            keys = mx.concatenate([k[..., : lo - first, :], keys], axis=2)
            values = mx.concatenate([v[..., : lo - first, :], values], axis=2)
            lo = first
        self.layers[layer] = (lo, keys, values)

    def record(self, target, cache, lo: int, hi: int):
        """Keep, for each sliding layer of ``cache``, the rows of positions lo..hi-1
        that a recompute from ``since`` reads and the layer still holds (a
        conversation's catch-up: rows written natively, or held from earlier turns,
        before later positions push them out of the window)."""
        for i, (c, lg) in enumerate(zip(cache, cache_geometry(target).layers)):
            a = max(self.reach(lg.window), lo) if lg.window else hi
            if a >= hi:
                continue
            keys, values, first = read_layer(c)
            if keys is None or first + keys.shape[2] < hi:
                continue
            a = max(a, first)
            self.add(i, a, keys[..., a - first: hi - first, :],
                     values[..., a - first: hi - first, :])

    def record_mapped(self, target, keys: List[mx.array], values: List[mx.array], hi: int):
        """Keep, for each sliding layer, the translated rows (content space, the last
        of positions ..hi-1) that a recompute from ``since`` reads: a catch-up's
        cache drops those older than the window as it writes them."""
        tables = None
        for i, lg in enumerate(cache_geometry(target).layers):
            if not lg.window:
                continue
            rows = keys[i].shape[1]
            a = max(self.reach(lg.window), hi - rows)
            if a < hi:
                tables = tables or RopeTables(target)
                self.add(i, a, *cache_rows(target, i, keys[i][:, a - hi + rows:],
                                           values[i][:, a - hi + rows:], a, tables))


def check_fits(target: nn.Module, n_target_tokens: int) -> None:
    """Refuse a context longer than the target model handles. Callers that prefill the
    source first call it before that work, so a long prompt fails at once."""
    limit = max_positions(target)
    if limit and n_target_tokens > limit:
        raise KvlingoError(
            f"The context has {n_target_tokens} target tokens; the target "
            f"model handles at most {limit} positions."
        )


def translate_into(source, target, translator, source_cache, target_cache, alignment, end,
               target_tokens, room: int, phases: Optional[dict] = None,
               early: Optional["EarlyLayer"] = None,
               history: Optional[History] = None) -> List:
    """:func:`translate_aligned` after the alignment is final. ``room``: positions the
    caller will add next (the first decoding step and any native tail), so that
    fresh caches are allocated with space for them. ``history``: also keep the rows
    before each sliding window that a recompute from ``history.since`` reads (see
    :class:`History`): a fresh cache translates them; extending a cache keeps its new
    rows as they are written."""
    if target_tokens is None:
        target_tokens = mx.array(alignment.target_tokens)[None]
    start = 0 if target_cache is None else cache_length(target_cache)
    if not start < end <= len(alignment.source_index):
        raise KvlingoError(
            f"Cannot translate positions {start}..{end - 1} of a "
            f"{len(alignment.source_index)}-token context."
        )
    check_fits(target, len(alignment.target_tokens))
    runs = alignment.runs(start, end)
    # Extending a live cache, its sliding layers drop rows a recompute may read:
    # they are kept in ``history`` as they are written (History.record*, which
    # skip layers without a window).
    recording = history is not None
    if target_cache is None and _fresh_block_fits(runs):
        recording = False  # the fresh path translates its history itself
        # The switch's case: [native prefix] + one translated block (+ native runs
        # after it), written straight into one preallocated buffer per layer.
        k = runs[0][2] if runs[0][0] else 0
        hi = runs[1][2] if runs[0][0] else runs[0][2]
        target_cache = _translate_fresh(source, target, translator, source_cache, alignment,
                                        target_tokens, k, hi, room + end - hi, phases, early,
                                        history)
        runs = alignment.runs(hi, end) if hi < end else []
    for native, lo, hi in runs:
        if native:
            target_cache = _native_run(target, target_tokens, lo, hi, target_cache)
            if recording:
                history.record(target, target_cache, lo, hi)
            continue
        idx = alignment.source_index[lo:hi]
        first, last = min(idx), max(idx)
        _check_source_holds(source_cache, last)
        keys, values, _ = cache_features(
            source, source_cache, translator.source_layers, span=(first, last + 1)
        )
        if idx != list(range(first, last + 1)):  # cross-tokenizer: gather per target token
            rows = mx.array([i - first for i in idx])
            keys = [k[:, rows] if k is not None else None for k in keys]
            values = [v[:, rows] if v is not None else None for v in values]
        # A sliding-window layer maps only the positions it keeps (a long
        # conversation span would otherwise map rows build_cache then drops).
        tk, tv = translator(keys, values, _token_rows(target, translator, target_tokens, lo, hi),
                            keep=_kept_rows(target, hi - lo, history if recording else None, hi))
        if _native_layer0(translator):  # computed by the target, not translated
            tk[0], tv[0] = layer0_features(target, target_tokens[:, lo:hi])
        if recording:
            history.record_mapped(target, tk, tv, hi)
        target_cache = build_cache(target, tk, tv, start=lo, cache=target_cache,
                                   length=hi - lo)
    return target_cache


def _kept_rows(target, n: int, history: Optional[History] = None, hi: int = 0
               ) -> Optional[List[Optional[int]]]:
    """Per target layer, how many of the ``n`` new positions ..hi-1 to map: those its
    cache keeps (the window of a sliding-window layer shorter than ``n``) and those
    ``history`` reads, else None (all); None when every layer maps all."""
    keep = []
    for lg in cache_geometry(target).layers:
        rows = n if lg.window is None else min(n, lg.window)
        if history is not None and lg.window is not None:
            rows = max(rows, min(n, hi - history.reach(lg.window)))
        keep.append(rows if rows < n else None)
    return keep if any(keep) else None


def _native_layer0(translator) -> bool:
    return getattr(translator.spec, "native_layer0", False)


def _token_rows(target, translator, target_tokens, lo: int, hi: int) -> Optional[mx.array]:
    """The target's token inputs of positions lo..hi-1, for a translator with token
    maps (None otherwise)."""
    if not getattr(translator.spec, "token_layers", None):
        return None
    return token_inputs(target, target_tokens, lo, hi)


def _check_source_holds(source_cache, last: int):
    if cache_length(source_cache) <= last:
        raise KvlingoError(
            f"The source cache holds {cache_length(source_cache)} tokens; "
            f"position {last} is needed."
        )


def _fresh_block_fits(runs) -> bool:
    """True when the runs start with [a native run,] one translated run."""
    if runs and runs[0][0]:
        runs = runs[1:]
    return bool(runs) and not runs[0][0]


def _translate_fresh(source, target, translator, source_cache, alignment, target_tokens,
                     k: int, hi: int, room: int, phases: Optional[dict] = None,
                     early: Optional["EarlyLayer"] = None,
                     history: Optional[History] = None) -> List:
    """A fresh target cache for positions 0..hi-1: 0..k-1 computed by the target (the
    memoized native prefix), k..hi-1 translated, with ``room`` free positions.

    The work is cut into *units*, the keys or the values of one target layer, and at
    most _UNITS_IN_FLIGHT units (and the next one's inputs) are alive at once: the
    peak holds about one layer's working set (source features and map outputs, K
    and V) beyond the caches, while the copy stream reads and writes one unit beside
    the matmuls of the next.

    Per unit the maps run over every row of the layer's buffer (its prefix and free
    rows too, a few wasted rows; with different tokenizers, over the source's rows
    when those are fewer, then gathered), so that the map outputs *are* the buffers:
    keys get re-rotated by one fused kernel that writes cache layout, values are
    transposed once, the prefix rows are overwritten in place. No concatenation
    copies the cache. (Units of rows written into one preallocated buffer held more,
    not less: a slice update queued behind another on the same buffer copies the
    whole buffer.) Sliding-window layers hold (and translate) only the positions
    they keep. ``early``: one layer's maps already queued over the source's rows
    (see :func:`map_early_layer`); its outputs are gathered. ``history``: the rows
    before a sliding window that a recompute reads are translated after the cache
    (:func:`_history_rows`), into ``history.layers``."""
    geometry = cache_geometry(target)
    dtype = cache_dtype(target)
    prefix = _prefix_kv(target, target_tokens, k) if k else None
    _phase(phases, "native_prefix_s", prefix or [])
    # Target positions [first, last) each layer's buffer covers.
    spans = []
    for lg in geometry.layers:
        if lg.window:
            first = max(hi - lg.window, 0)
            spans.append((first, hi + min(room, max(lg.window - hi, 0))))
        else:
            spans.append((0, hi + room))
    # Source layers each target layer reads; none for a layer the target computes.
    layer_map = [[] if i == 0 and _native_layer0(translator) else layers
                 for i, layers in enumerate(translator.spec.layer_map)]
    top = max(last for _, last in spans)
    tokens = _token_rows(target, translator, target_tokens, 0, top)
    # Source positions per target position (-1: prefix and free rows, any row will do).
    index = np.full(top, -1, dtype=np.int64)
    index[:hi] = np.maximum(np.asarray(alignment.source_index[:hi], dtype=np.int64), -1)
    shared = bool(np.all((index < 0) | (index == np.arange(top))))
    plans = {}  # per distinct row range (full layers, sliding windows): built once

    def plan(first, last):
        if (first, last) not in plans:
            plans[first, last] = _RowPlan.of(index[first:last], first, shared)
        return plans[first, last]

    # Different tokenizers: a layer maps the source's rows, then gathers the outputs
    # per target row, where the source holds fewer rows than the target reads (the
    # maps act per token, so this is the same result for fewer multiply-adds: Gemma
    # 3 -> SmolLM2, ~7% fewer); otherwise it gathers its inputs first.
    def fewer_source_rows(first, last):
        p = plan(first, last)
        return p.top - p.lo + 1 < last - first

    # A compressed translator projects every target row once per kind (below); its
    # maps read that projection, already one row per target row.
    compressed = bool(translator.spec.shared_rank)
    map_first = {i: not shared and not compressed and fewer_source_rows(*spans[i])
                 for i, layers in enumerate(layer_map) if layers}
    # Layers in order of size, largest first (stable): the copy stream's reads and
    # rotations of one layer overlap the matmuls of its neighbours in this order, so
    # a model mixing full and sliding-window layers (Gemma 3: 1 full in 6) must not
    # put each large layer between small ones, whose matmuls hide nothing of its
    # copies (SmolLM2 -> Gemma 3 at 4096 tokens: no overlap at all in model order).
    order = sorted(range(len(spans)), key=lambda i: spans[i][0] - spans[i][1])
    if early is not None and spans[early.layer] != (0, top):
        early = None  # not a layer over every row (a caller's other geometry): unused
    units = [(i, kind) for i in order for kind in "kv"]
    copies = _copy_stream() if phases is None else None

    projected = {}  # kind -> a compressed translator's shared projection, all rows

    def inputs(i, kind):
        """Layer i's map inputs of one kind (with map_first, over their source rows),
        read for this unit alone: a source layer that feeds several target layers
        is read by each (holding it for the next reader held another layer's
        features beside the units in flight). A compressed translator's: the rows
        of the shared projection, made at the kind's first unit."""
        if compressed:
            if kind not in projected:
                p = plan(0, top)
                parts = [_source_rows(source, source_cache, j, p, kind, copies)
                         for j in translator.source_layers]
                if translator.spec.shared_tokens:  # the token inputs, folded in
                    parts.append(tokens[:, :top].astype(parts[0].dtype))
                with _on(copies):
                    x = _concat(parts)
                shared_map = translator.k_shared if kind == "k" else translator.v_shared
                projected[kind] = shared_map(x)
            first, last = spans[i]
            return projected[kind][:, first:last]
        p = plan(*spans[i])
        if map_first[i]:
            parts = [_source_range(source, source_cache, j, p.lo, p.top, kind, copies)
                     for j in layer_map[i]]
        else:
            parts = [_source_rows(source, source_cache, j, p, kind, copies)
                     for j in layer_map[i]]
        with _on(copies):
            return _concat(parts)

    ready = {}  # unit -> its map inputs, queued on the copy stream ahead of time

    def read_ahead(u):
        """Queue unit u's map inputs on the copy stream *now*: a stream
        runs its tasks in the order they were queued, so inputs queued with their
        unit (after the previous unit's rotations, which wait for that unit's
        matmuls) would make every unit's matmuls wait for the previous unit's
        copies; queued a unit ahead, they are ready when the matmuls are."""
        if u >= len(units):
            return
        i, kind = units[u]
        if layer_map[i] and (early is None or i != early.layer):
            ready[u] = inputs(i, kind)
            if phases is None:
                mx.async_eval(ready[u])

    cache = make_prompt_cache(target)
    keys_of = {}  # layer -> its keys buffer, until its values are written
    read_ahead(0)
    in_flight = []
    for u, (i, kind) in enumerate(units):
        lg, layers = geometry.layers[i], layer_map[i]
        first, last = spans[i]
        rows = last - first
        # async_eval returns at once: without a wait the loop would queue every
        # unit's work, and their intermediates would pile up. Waiting for the unit
        # two back keeps two units and the next one's inputs (read ahead) in
        # flight, at most about one layer's working set. One unit in flight halves
        # the peak but leaves Python building each unit's graph while nothing runs
        # (idle, SmolLM2 -> SmolLM2: 23.9 vs 13.3 ms at 256 tokens, 78 vs 54 ms at
        # 1024); three or more are no faster than two.
        #
        # The last _DRAINED_TAIL units run one at a time: by then the cache is all but
        # complete, so two units' intermediates on top of it were the switch's peak
        # (Gemma 3 -> SmolLM2 at 4096 tokens: 1.42 MB over one layer's working set;
        # drained, 0.85 MB under), and there is nothing left to overlap anyway.
        limit = 1 if u >= len(units) - _DRAINED_TAIL else _UNITS_IN_FLIGHT
        while len(in_flight) >= limit:
            mx.eval(in_flight.pop(0))
        if not layers:  # layer 0 computed by the target itself: exact, prefix included
            read_ahead(u + 1)
            if kind == "k":  # both at once; the values wait for their unit
                keys_of[i], values0 = _layer0_rows(target, target_tokens, first, hi, rows, dtype)
            out = keys_of[i] if kind == "k" else values0
            _phase(phases, "native_prefix_s", [out])  # target-computed K/V
        else:
            if early is not None and i == early.layer:
                read_ahead(u + 1)
                _check_source_holds(source_cache, int(index.max()))  # the gather cannot
                with _on(copies):
                    out = early.gather(index, kind)
            else:
                # Several source layers per map: concatenated on the copy stream,
                # beside the previous unit's matmuls (read_ahead).
                x = ready.pop(u)
                read_ahead(u + 1)
                _phase(phases, "read_unrope_s", [x])
                out = (translator.k_maps if kind == "k" else translator.v_maps)[i](x)
                del x
                if map_first[i]:  # one output row per target row
                    with _on(copies):
                        out = out[:, plan(first, last).rows]
            tok = translator.token_map(i, kind) if tokens is not None else None
            if tok is not None:  # the target's own token embeddings' term
                out = out + tok(tokens[:, first:last]).astype(out.dtype)
            _phase(phases, "maps_s", [out])
            out = _cache_layout(target, i, lg, kind, out, first, dtype, prefix, k, copies)
            if kind == "k":
                keys_of[i] = out
        if kind == "v":
            set_layer(cache[i], keys_of.pop(i), out, hi, hi - first)
        _phase(phases, "rerope_write_s", [out])
        if phases is None:
            mx.async_eval(out)
            in_flight.append(out)
        del out
    if history is not None:
        _history_rows(history, spans, geometry, layer_map, prefix, k, dtype, copies,
                      project=lambda kind, lo, hi: projected[kind][:, lo:hi] if compressed
                      else None, plan=plan, source=source, source_cache=source_cache,
                      translator=translator, target=target, tokens=tokens,
                      target_tokens=target_tokens)
    return cache


def _history_rows(history: History, spans, geometry, layer_map, prefix, k: int, dtype,
                  copies, project, plan, source, source_cache, translator, target, tokens,
                  target_tokens):
    """Translate, per sliding layer of the switch, positions max(0, since - window +
    1).. up to its first kept row into ``history.layers``: the maps over those rows
    alone (a compressed translator's read its shared projection, made already; a
    layer 0 the target computes itself, computed)."""
    for i, ((first, _), lg) in enumerate(zip(spans, geometry.layers)):
        lo = max(history.since - lg.window + 1, 0) if lg.window else first
        if lo >= first or first <= k:  # (rows all in the native prefix: a toy window)
            continue
        if not layer_map[i]:
            keys, values = layer0_kv(target, target_tokens[:, lo:first], lo)
            history.layers[i] = (lo, keys.astype(dtype), values.astype(dtype))
            continue
        out = {}
        for kind in "kv":
            x = project(kind, lo, first)
            if x is None:
                p = plan(lo, first)
                with _on(copies):
                    x = _concat([_source_rows(source, source_cache, j, p, kind, copies)
                                 for j in layer_map[i]])
            y = (translator.k_maps if kind == "k" else translator.v_maps)[i](x)
            tok = translator.token_map(i, kind) if tokens is not None else None
            if tok is not None:
                y = y + tok(tokens[:, lo:first]).astype(y.dtype)
            out[kind] = _cache_layout(target, i, lg, kind, y, lo, dtype, prefix, k, copies)
        history.layers[i] = (lo, out["k"], out["v"])


def _cache_layout(target, i: int, lg, kind: str, x, first: int, dtype, prefix, k: int,
                  stream):
    """Map outputs [B, rows, heads*head_dim] of layer i's positions first.. ->
    [B, heads, rows, head_dim] in cache layout (keys rotated to their positions),
    with the native prefix (positions < k) written over its rows in place."""
    B, rows = x.shape[:2]
    with _on(stream):
        x = x.reshape(B, rows, lg.n_kv_heads, lg.head_dim)
        x = x.transpose(0, 2, 1, 3)  # a view: the rotation writes cache layout
        if kind == "k":
            rope = target.layers[i].self_attn.rope
            planes = rope_planes(target, i, first, rows, lg.head_dim)
            if planes is None:
                x = rerope(rope, x, first).astype(dtype)
            else:
                x = rotate_planes(x, planes, getattr(rope, "traditional", False), dtype)
        else:
            x = mx.contiguous(x.astype(dtype))
        if first < k:  # the native prefix
            x[..., : k - first, :] = prefix[i][0 if kind == "k" else 1][..., first:, :]
    return x


_UNITS_IN_FLIGHT = 2
_DRAINED_TAIL = 2  # last units run alone (_translate_fresh); 1 left S -> G at 256 over in 2 of 8


@dataclass
class EarlyLayer:
    """One target layer's map outputs over source positions lo..top (keys, values
    [B, rows, heads*head_dim]), computed before the alignment was known."""

    layer: int
    keys: mx.array
    values: mx.array
    lo: int

    def gather(self, index: np.ndarray, kind: str):
        """One output row per target row of ``index`` (source positions; -1: any) of
        the keys or values (``kind``); they are dropped once gathered (callers up
        the stack still hold this object)."""
        rows = mx.array((np.maximum(index, self.lo) - self.lo).astype(np.int32))
        out = getattr(self, _KINDS[kind])[:, rows]
        setattr(self, _KINDS[kind], None)
        return out


_KINDS = {"k": "keys", "v": "values"}


def map_early_layer(source, target, translator, source_cache) -> Optional[EarlyLayer]:
    """Queue the first full target layer's maps over every row the source holds,
    before the text is aligned: they need no alignment (a gather picks the target's
    rows afterwards), so the streams map one layer while Python tokenizes for the
    target (~5-8 ms at 4,000 tokens). None where nothing runs beside Python (no
    second stream) or no layer qualifies."""
    if _copy_stream() is None or translator.spec.shared_rank:
        return None  # (a compressed translator's maps read a projection of every row)
    geometry = cache_geometry(target)
    layers = [i for i, (lg, js) in enumerate(zip(geometry.layers, translator.spec.layer_map))
              if js and not lg.window and not (i == 0 and _native_layer0(translator))]
    n = cache_length(source_cache)
    if not layers or n < 1:
        return None
    i, lo = layers[0], 0
    try:  # all on the matmuls' stream: the other core is Python's while it aligns
        parts = [(_source_range(source, source_cache, j, lo, n - 1, "k"),
                  _source_range(source, source_cache, j, lo, n - 1, "v"))
                 for j in translator.spec.layer_map[i]]
    except KvlingoError:  # e.g. a sliding-window source layer: the usual path says why
        return None
    xk, xv = _concat([p[0] for p in parts]), _concat([p[1] for p in parts])
    early = EarlyLayer(i, translator.k_maps[i](xk), translator.v_maps[i](xv), lo)
    mx.async_eval(early.keys, early.values)
    return early


def _layer0_rows(target, tokens, first: int, hi: int, rows: int, dtype):
    """A layer-0 cache buffer of ``rows`` rows: the target's own K/V of positions
    first..hi-1, then free rows (zeros) for the tokens that come next."""
    keys, values = layer0_kv(target, tokens[:, first:hi], first)
    if rows > hi - first:
        B, H, _, D = keys.shape
        free = mx.zeros((B, H, rows - (hi - first), D), dtype)
        keys = mx.concatenate([keys.astype(dtype), free], axis=2)
        values = mx.concatenate([values.astype(dtype), free], axis=2)
    return keys.astype(dtype), values.astype(dtype)


def _phase(phases: Optional[dict], name: str, arrays):
    """Profiling only (``phases`` given): evaluate what is built so far and add the
    time since the previous mark to ``phases[name]`` (summed over layers)."""
    if phases is None:
        return
    mx.eval(arrays)
    now = time.perf_counter()
    phases[name] = phases.get(name, 0.0) + now - phases.get("_mark", now)
    phases["_mark"] = now


@dataclass
class _RowPlan:
    """Which source positions a layer buffer's rows read: row r (target position
    first + r) holds source position ``lo + rows[r]``; ``shared``: that is position
    first + r wherever it matters (a shared tokenizer). Built once per switch and
    distinct first row, so the per-layer work does no Python loop over the context."""

    first: int
    count: int
    lo: int
    top: int
    offsets: np.ndarray
    shared: bool
    _rows: Optional[mx.array] = None

    @classmethod
    def of(cls, index: np.ndarray, first: int, shared: bool) -> "_RowPlan":
        wanted = index[index >= 0]
        lo, top = int(wanted.min()), int(wanted.max())
        offsets = (np.where(index >= 0, index, lo) - lo).astype(np.int32)
        return cls(first, len(index), lo, top, offsets, shared)

    @property
    def rows(self) -> mx.array:
        if self._rows is None:  # made when first gathered with (not on a shared pair's path)
            self._rows = mx.array(self.offsets)
        return self._rows


def _source_rows(source, source_cache, layer: int, plan: _RowPlan, kind: str, stream=None):
    """Content-space keys (``kind`` "k") or values ("v"), [B, plan.count,
    heads*head_dim], of source ``layer``, row r holding the source position the plan
    gives it (rows no map output is read from hold any position). The work runs on
    ``stream`` (default: the current stream).

    A shared tokenizer reads a contiguous range of the cache's own buffer (spare
    rows past its length included), un-rotated and flattened by one fused kernel.
    Otherwise the range the rows need is read the same way and its rows gathered."""
    _check_source_holds(source_cache, plan.top)
    c = source_cache[layer]
    first, n = plan.first, plan.count
    if plan.shared and type(c) is KVCache and c.keys is not None \
            and c.keys.shape[2] >= first + n:
        with _on(stream):
            if kind == "k":
                return _content_keys(source, layer, c.keys[..., first : first + n, :], first)
            B, H, _, D = c.values.shape
            return c.values[..., first : first + n, :].transpose(0, 2, 1, 3).reshape(B, n, H * D)
    x = _source_range(source, source_cache, layer, plan.lo, plan.top, kind, stream)
    with _on(stream):
        # Gather whole rows of the flat [B, T, H*D] layout (mx.take along the
        # positions of the cache layout, to save a pass, was 2-5x slower here).
        return x[:, plan.rows]


def _source_range(source, source_cache, layer: int, lo: int, top: int, kind: str,
                  stream=None):
    """Content-space keys or values (``kind``) [B, top - lo + 1, heads*head_dim] of
    source ``layer`` at positions lo..top, computed on ``stream``."""
    _check_source_holds(source_cache, top)
    keys, values, s = read_layer(source_cache[layer])
    if keys is None or s > lo:
        raise KvlingoError(
            f"Layer {layer} of the source cache holds positions {s}.."
            f"{s + (0 if keys is None else keys.shape[2]) - 1}, but positions "
            f"{lo}..{top} are needed: a sliding-window layer has dropped early "
            "tokens. Prefill the source in one pass (mlx_kvlingo.models.prefill) to get "
            "complete features."
        )
    x = (keys if kind == "k" else values)[..., lo - s : top + 1 - s, :]
    B, H, n, D = x.shape
    with _on(stream):
        if kind == "k":
            return _content_keys(source, layer, x, lo)
        return x.transpose(0, 2, 1, 3).reshape(B, n, H * D)


def _content_keys(source, layer: int, keys, start: int):
    """Source keys [B, H, T, D] at positions start.. -> content space [B, T, H*D]."""
    B, H, n, D = keys.shape
    planes = rope_planes(source, layer, start, n, D, inverse=True)
    rope = source.layers[layer].self_attn.rope
    if planes is None:
        keys = unrope(rope, keys, start).transpose(0, 2, 1, 3)
    else:  # [B, T, H, D] out of a transposed view: un-rotated and flattened in one pass
        C, S = planes
        keys = rotate_planes(keys.transpose(0, 2, 1, 3), (C[:, None], S[:, None]),
                             getattr(rope, "traditional", False))
    return keys.reshape(B, n, H * D)


def _on(stream):
    return mx.stream(stream) if stream is not None else contextlib.nullcontext()


_COPY_STREAM = []  # one thread-local CPU stream, made once


def _copy_stream():
    """The stream the switch's rotations and layout copies run on, beside the map
    matmuls on the default stream: on a CPU the two run on two cores at once (MLX
    runs each stream on its own thread), so the memory-bound copies of one layer
    overlap the matmuls of the next. Thread-local (as mlx-lm's generation stream),
    so switches may run on any thread. None where that does not apply."""
    if mx.default_device() != mx.cpu or not _PARALLEL_STREAMS:
        return None
    if not _COPY_STREAM:
        _COPY_STREAM.append(mx.new_thread_local_stream(mx.cpu))
    return _COPY_STREAM[0]


_PARALLEL_STREAMS = True


def _concat(xs: List[mx.array]) -> mx.array:
    return xs[0] if len(xs) == 1 else mx.concatenate(xs, axis=-1)


def _prefix_kv(target, tokens, k: int) -> List:
    """Per layer (keys, values) of target positions 0..k-1 computed by the target. They
    depend only on their token ids, so they are memoized per model (B = 1): a
    switch then costs no extra forward pass for the native prefix."""
    if tokens.shape[0] != 1:
        return [read_layer(c)[:2] for c in prefill(target, tokens[:, :k])]
    memo = target.__dict__.get("_kvlingo_prefix_kv")
    if memo is None:  # object.__setattr__: a dict set through nn.Module becomes a child
        memo = {}
        object.__setattr__(target, "_kvlingo_prefix_kv", memo)
    key = tuple(tokens[0, :k].tolist())
    if key not in memo:
        if len(memo) >= 16:
            memo.clear()
        memo[key] = [read_layer(c)[:2] for c in prefill(target, tokens[:, :k])]
        mx.eval(memo[key])
    return memo[key]


def _native_run(target, tokens, lo: int, hi: int, cache):
    """Positions lo..hi-1 computed by the target itself (from position 0: the
    memoized native prefix)."""
    if lo:
        return prefill(target, tokens[:, lo:hi], cache)
    cache = make_prompt_cache(target) if cache is None else cache
    for c, (k, v) in zip(cache, _prefix_kv(target, tokens, hi)):
        append_layer(c, k, v, 0, hi)
    return cache
