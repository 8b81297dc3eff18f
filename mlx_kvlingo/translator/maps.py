"""The translator: per target layer one K map and one V map, and the file it lives in.

A map is a bias-free dense matrix over the flattened KV heads of one token, so head
counts and head dims may differ between the models. Target layer ``i`` reads the
content-space features of the source layers ``layer_map[i]`` concatenated (one layer
by default, the nearest in relative depth). A *compressed* translator
(``spec.shared_rank``, :mod:`.compress`) first projects the concatenated features of
every source layer any map reads (``source_layers``) onto a few shared directions per
kind, once per token, and each map reads that projection: one small matmul per
layer instead of one over all its source layers.

File format: one safetensors file. Tensors ``k_maps.{i}.weight`` and
``v_maps.{i}.weight`` ([target width, source width x len(layer_map[i])], float32);
metadata key ``mlx_kvlingo`` holds the JSON of :class:`TranslatorSpec`. A file saved
with ``bits`` (8 or 4) stores each map whose input width is a multiple of 64 quantized
as ``nn.QuantizedLinear`` lays it out (``weight`` packed in uint32, ``scales`` and
``biases`` per 64 inputs), under metadata key ``mlx_kvlingo.quantization``; it loads
back dequantized to float32, so a switch runs the same float32 matmuls either way.
A compressed file also holds ``k_shared.weight`` and ``v_shared.weight`` ([rank,
width of all of ``source_layers``]), and its maps are [target width, rank].
"""

import json
import math
import struct
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import KvlingoError, TranslatorFileError, TranslatorMismatch
from ..files import save_safetensors_atomic
from ..models.features import supports_native_layer0, token_input_width
from ..models.geometry import CacheGeometry, cache_geometry, model_name, tokenizer_fingerprint
from .hub import resolve_translator

# The newest file format this version reads and writes. 2: token maps
# (spec.token_layers); 3: a shared projection (spec.shared_rank). A file without
# them is written as the oldest version that holds it, without the new fields, so
# older mlx-kvlingo still reads it.
FORMAT_VERSION = 3
METADATA_KEY = "mlx_kvlingo"
QUANT_KEY = "mlx_kvlingo.quantization"
QUANT_GROUP = 64  # inputs sharing one scale and bias (SmolLM2's and Gemma's widths divide it)
ALIGNMENTS = ("shared", "last_char")


@dataclass
class ModelIdentity:
    """What a translator knows about one of its two models."""

    name: str
    geometry: dict
    fingerprint: str
    tokenizer: Optional[str] = None  # tokenizer fingerprint, when known

    @classmethod
    def of(cls, model: nn.Module, tokenizer=None) -> "ModelIdentity":
        g = cache_geometry(model)
        tok = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
        geometry = json.loads(json.dumps(g.to_dict()))  # tuples -> lists, as in a file
        return cls(model_name(model), geometry, g.fingerprint(), tok)

    @property
    def cache_geometry(self) -> CacheGeometry:
        return CacheGeometry.from_dict(self.geometry)


@dataclass
class TranslatorSpec:
    source: ModelIdentity
    target: ModelIdentity
    layer_map: List[List[int]]  # source layers feeding each target layer
    native_prefix: int = 1  # first context tokens the target computes itself
    # "shared": both models use one tokenizer, position j reads position j;
    # "last_char": different tokenizers, each target token reads the source token
    # containing its last character (align.py).
    alignment: str = "shared"
    training: dict = field(default_factory=dict)  # how the maps were made
    format_version: int = 1  # 2 with token maps (__post_init__)
    # Default number of trailing context tokens the target computes itself at a
    # switch (the "native tail", on top of the translated cache).
    native_tail: int = 0
    # Default share of the context's positions the target recomputes itself at a
    # switch (its fact-like words; switching.recompute), and the most positions that
    # share may come to (0: no limit). A recompute costs about its share of a
    # re-prefill, so a cap keeps long contexts' switches cheap. Files written
    # before these fields: none.
    recompute: float = 0.0
    recompute_max: int = 0
    # Positions the default budget leaves out: it recomputes ``recompute`` of the
    # context less these (the switch's own fixed cost, in positions), so that its
    # time stays about the same share of a re-prefill's at every length (see
    # switching.api.RecomputeBudget). Files written before this field: 0.
    recompute_reserve: int = 0
    # How the recompute's positions are chosen (switching.api.SELECTIONS):
    # "question", the positions the question reads at the switch, with the
    # fact-like words; "source", the same read by the source on its own cache;
    # "lexical", the fact-like words only. Files written before this field:
    # "question".
    recompute_select: str = "question"
    # Text that goes on needs a long native tail more than a recompute: a one-shot
    # switch whose source finds that the next token reaches little beyond the last
    # ``long_tail`` context tokens (the KL of its next token reading only them from
    # reading everything, switching.query.last_token_reading, at most
    # ``long_tail_reach`` nats) lets the target compute those tokens itself and
    # recomputes nothing; a question about a distant fact reaches further and gets
    # the defaults above. Read by the source's probe: with recompute_select
    # "source" and a recompute only. Files written before these fields: 0 (always
    # the defaults).
    long_tail: int = 0
    long_tail_reach: float = 0.0
    # Catch-ups that would translate fewer positions prefill them instead (a switch
    # that short costs more than it saves): the break-even measured where the file's
    # defaults were set (switching.break_even). A machine's own measurement replaces
    # it. Files written before this field: 0 (every catch-up translates).
    break_even: int = 0
    # The target computes its layer-0 K/V itself instead of translating them (they
    # depend only on each token and its position: exact, and cheap). The maps of
    # layer 0 stay in the file, unused. Files written before this field: off.
    native_layer0: bool = False
    # Target layers whose K and V maps also read the target's own embeddings of each
    # position's token and the token before it (models.token_inputs, width
    # ``token_width``), added to what they read from the source. Files written
    # before these fields: none.
    token_layers: List[int] = field(default_factory=list)
    token_width: int = 0
    # A compressed translator: {"k": rank, "v": rank}, the width of the shared
    # projection of every source layer's keys / values that all maps read (see the
    # module docstring). Empty: each map reads its source layers directly.
    shared_rank: Dict[str, int] = field(default_factory=dict)
    # A compressed translator whose projection also reads the target's token inputs
    # (its token maps folded in: no separate token maps).
    shared_tokens: bool = False

    def __post_init__(self):
        if self.token_layers and self.format_version == 1:
            self.format_version = 2  # a reader of version 1 would drop the token maps
        if self.shared_rank and self.format_version < 3:
            self.format_version = 3  # an older reader would find the shapes wrong

    def to_json(self) -> str:
        d = asdict(self)
        if not self.token_layers:  # a version-1 file, as older versions wrote it
            del d["token_layers"], d["token_width"]
        if not self.shared_rank:
            del d["shared_rank"], d["shared_tokens"]
        if not self.recompute:
            del d["recompute"], d["recompute_max"]
        if not self.recompute or not self.recompute_reserve:
            del d["recompute_reserve"]
        if not self.recompute or self.recompute_select == "question":
            del d["recompute_select"]
        if not self.long_tail:
            del d["long_tail"], d["long_tail_reach"]
        if not self.break_even:  # as files written before the field
            del d["break_even"]
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TranslatorSpec":
        d = json.loads(text)
        d["source"] = ModelIdentity(**d["source"])
        d["target"] = ModelIdentity(**d["target"])
        return cls(**d)


def nearest_layer_map(n_source: int, n_target: int, per_layer: int = 1) -> List[List[int]]:
    """For each target layer, ``per_layer`` adjacent source layers centred on the one
    at the nearest relative depth."""
    if not 1 <= per_layer <= n_source:
        raise ValueError(f"per_layer must be in 1..{n_source}, got {per_layer}")
    out = []
    for i in range(n_target):
        centre = round(i * (n_source - 1) / max(n_target - 1, 1))
        first = min(max(centre - (per_layer - 1) // 2, 0), n_source - per_layer)
        out.append(list(range(first, first + per_layer)))
    return out


class Translator(nn.Module):
    def __init__(self, spec: TranslatorSpec):
        super().__init__()
        self.spec = spec  # not an array, dict or list: a plain attribute, not a parameter
        src = spec.source.cache_geometry.layers
        tgt = spec.target.cache_geometry.layers
        if len(spec.layer_map) != len(tgt):
            raise TranslatorFileError(
                f"layer_map has {len(spec.layer_map)} entries for {len(tgt)} target layers"
            )
        if spec.shared_rank:
            union = sum(src[j].width for j in self.source_layers)
            union += spec.token_width if spec.shared_tokens else 0
            self.k_shared = nn.Linear(union, spec.shared_rank["k"], bias=False)
            self.v_shared = nn.Linear(union, spec.shared_rank["v"], bias=False)
            k_widths = [spec.shared_rank["k"]] * len(tgt)
            v_widths = [spec.shared_rank["v"]] * len(tgt)
        else:
            k_widths = v_widths = [sum(src[j].width for j in layers)
                                   for layers in spec.layer_map]
        self.k_maps = [nn.Linear(w, t.width, bias=False) for w, t in zip(k_widths, tgt)]
        self.v_maps = [nn.Linear(w, t.width, bias=False) for w, t in zip(v_widths, tgt)]
        # The token maps of spec.token_layers, in that order (none where a
        # compressed translator's projection reads the token inputs itself).
        separate = [] if spec.shared_tokens else spec.token_layers
        self.k_tok = [nn.Linear(spec.token_width, tgt[i].width, bias=False) for i in separate]
        self.v_tok = [nn.Linear(spec.token_width, tgt[i].width, bias=False) for i in separate]

    @classmethod
    def for_models(
        cls,
        source: nn.Module,
        target: nn.Module,
        source_tokenizer=None,
        target_tokenizer=None,
        sources_per_layer: int = 1,
        native_prefix: int = 1,
        token_layers: Sequence[int] = (),
    ) -> "Translator":
        """A translator (maps still random) for a pair of loaded models.
        ``token_layers``: target layers whose maps also read the target's token
        inputs (:func:`~mlx_kvlingo.models.token_inputs`)."""
        s = ModelIdentity.of(source, source_tokenizer)
        t = ModelIdentity.of(target, target_tokenizer)
        n_s, n_t = len(s.geometry["layers"]), len(t.geometry["layers"])
        layer_map = nearest_layer_map(n_s, n_t, sources_per_layer)
        alignment = "shared" if s.tokenizer == t.tokenizer else "last_char"
        token_layers = sorted({int(i) for i in token_layers})
        if any(not 0 <= i < n_t for i in token_layers):
            raise KvlingoError(f"token layers {token_layers} must lie in 0..{n_t - 1}.")
        width = token_input_width(target) if token_layers else 0
        return cls(TranslatorSpec(s, t, layer_map, native_prefix, alignment=alignment,
                                  token_layers=token_layers, token_width=width))

    def with_native_layer0(self, on: bool) -> "Translator":
        """The same maps (shared, not copied) with layer 0 computed by the target
        itself (``on``) or translated."""
        if bool(on) == self.spec.native_layer0:
            return self
        t = Translator(replace(self.spec, native_layer0=bool(on)))
        t.k_maps, t.v_maps = self.k_maps, self.v_maps
        if self.spec.shared_rank:
            t.k_shared, t.v_shared = self.k_shared, self.v_shared
        t.k_tok, t.v_tok = self.k_tok, self.v_tok
        return t

    @property
    def cross_tokenizer(self) -> bool:
        return self.spec.alignment != "shared"

    def __call__(self, keys: List[mx.array], values: List[mx.array],
                 tokens: Optional[mx.array] = None, keep: Optional[List] = None):
        """Map source content-space K/V (lists over source layers of [B, T, width])
        to target content-space K/V (lists over target layers). ``tokens``: the
        target's :func:`~mlx_kvlingo.models.token_inputs` of the same positions,
        needed when ``spec.token_layers`` is not empty. ``keep``: per target layer,
        map only the last ``keep[i]`` positions (None: all), e.g. the rows a
        sliding-window layer keeps; that layer's output then has only those rows."""
        if self.spec.shared_tokens:
            return self._map_shared(keys, values, keep, tokens)
        out_k, out_v = self.map_sources(keys, values, keep)
        return self.add_token_terms(out_k, out_v, tokens, keep)

    def map_sources(self, keys: List[mx.array], values: List[mx.array],
                    keep: Optional[List] = None):
        """The maps' source terms alone (all of a translator without token layers)."""
        if self.spec.shared_tokens:
            raise KvlingoError("This compressed translator's projection reads the target's "
                               "token inputs too: call the translator with tokens=.")
        if self.spec.shared_rank:
            return self._map_shared(keys, values, keep)
        out_k, out_v = [], []
        for i, (layers, km, vm) in enumerate(zip(self.spec.layer_map, self.k_maps, self.v_maps)):
            out_k.append(km(_concat([_last_rows(keys[j], keep, i) for j in layers])))
            out_v.append(vm(_concat([_last_rows(values[j], keep, i) for j in layers])))
        return out_k, out_v

    def _map_shared(self, keys: List[mx.array], values: List[mx.array],
                    keep: Optional[List] = None, tokens: Optional[mx.array] = None):
        """map_sources of a compressed translator: one shared projection per kind,
        over all rows (with ``spec.shared_tokens``, of the token inputs too), then
        each layer's map over the rows it keeps."""
        zk, zv = self.shared_projections(keys, values, tokens)
        out_k = [km(_last_rows(zk, keep, i)) for i, km in enumerate(self.k_maps)]
        out_v = [vm(_last_rows(zv, keep, i)) for i, vm in enumerate(self.v_maps)]
        return out_k, out_v

    def shared_projections(self, keys: List[mx.array], values: List[mx.array],
                           tokens: Optional[mx.array] = None):
        """A compressed translator's shared projections of keys and of values, over
        all rows: what each layer's map reads. ``tokens``: the target's token inputs,
        read with ``spec.shared_tokens`` (and needed then)."""
        union = self.source_layers
        extra = ([self._tokens(tokens).astype(keys[union[0]].dtype)]
                 if self.spec.shared_tokens else [])
        return (self.k_shared(_concat([keys[j] for j in union] + extra)),
                self.v_shared(_concat([values[j] for j in union] + extra)))

    def _tokens(self, tokens: Optional[mx.array]) -> mx.array:
        if tokens is None:
            raise KvlingoError(
                "This translator's maps also read the target's token embeddings: pass "
                "tokens=models.token_inputs(...).")
        return tokens

    def add_token_terms(self, out_k: List[mx.array], out_v: List[mx.array],
                        tokens: Optional[mx.array], keep: Optional[List] = None):
        """``out_k``/``out_v`` (per target layer) plus the token maps' terms."""
        if not self.spec.token_layers or self.spec.shared_tokens:
            return out_k, out_v
        if tokens is None:
            raise KvlingoError(
                "This translator's maps also read the target's token embeddings "
                f"(layers {self.spec.token_layers}): pass tokens=models.token_inputs(...)."
            )
        out_k, out_v = list(out_k), list(out_v)
        for i, kt, vt in zip(self.spec.token_layers, self.k_tok, self.v_tok):
            x = _last_rows(tokens, keep, i)
            out_k[i] = out_k[i] + kt(x).astype(out_k[i].dtype)
            out_v[i] = out_v[i] + vt(x).astype(out_v[i].dtype)
        return out_k, out_v

    def token_map(self, layer: int, kind: str) -> Optional[nn.Linear]:
        """Target layer ``layer``'s token map for keys ("k") or values ("v"), if any."""
        if layer not in self.spec.token_layers or self.spec.shared_tokens:
            return None
        j = self.spec.token_layers.index(layer)
        return (self.k_tok if kind == "k" else self.v_tok)[j]

    @property
    def source_layers(self) -> List[int]:
        """Source layers any map reads, so callers extract only these."""
        return sorted({j for layers in self.spec.layer_map for j in layers})

    # -- checking against models -------------------------------------------

    def check_models(self, source, target, source_tokenizer=None, target_tokenizer=None):
        """Raise TranslatorMismatch naming every field where the models differ from
        the ones this translator was made for."""
        problems = []
        for role, ident, model, tok in (
            ("source", self.spec.source, source, source_tokenizer),
            ("target", self.spec.target, target, target_tokenizer),
        ):
            problems += _geometry_differences(
                role, ident.cache_geometry, cache_geometry(model)
            )
            if tok is not None and ident.tokenizer is not None:
                if tokenizer_fingerprint(tok) != ident.tokenizer:
                    problems.append(
                        f"{role} tokenizer: vocabulary differs from the one the "
                        "translator was trained with"
                    )
        if self.spec.token_layers and token_input_width(target) != self.spec.token_width:
            problems.append(
                f"the translator's token maps read {self.spec.token_width} embedding "
                f"features, the target's embeddings give {token_input_width(target)}"
            )
        if self.spec.native_layer0 and not supports_native_layer0(target):
            problems.append(
                f"the translator computes layer 0 natively, which is not supported for "
                f"{getattr(target, 'model_type', '?')} targets"
            )
        if source_tokenizer is not None and target_tokenizer is not None:
            same = tokenizer_fingerprint(source_tokenizer) == tokenizer_fingerprint(target_tokenizer)
            if same and self.cross_tokenizer:
                problems.append("the models share a tokenizer but the translator is cross-tokenizer")
            if not same and not self.cross_tokenizer:
                problems.append(
                    "the models' tokenizers differ but the translator was trained for a "
                    "shared tokenizer (position j -> position j); it cannot align them"
                )
        if problems:
            raise TranslatorMismatch(
                f"Translator {self.spec.source.name} -> {self.spec.target.name} does not "
                f"fit {model_name(source)} -> {model_name(target)}:\n  - "
                + "\n  - ".join(problems)
            )

    # -- files ---------------------------------------------------------------

    def save(self, path, dtype: mx.Dtype = mx.float32, bits: Optional[int] = None):
        """Write the translator atomically (temporary file, then rename); ``dtype``
        float32 or float16 (half the size; loads back as float32). ``bits`` (8 or 4)
        also quantizes every map whose input width is a multiple of 64, group-wise
        (scales and biases in ``dtype``): 8 bits is about half of float16's size."""
        if dtype not in (mx.float32, mx.float16):
            raise ValueError("Translators are saved in float32 or float16.")
        if bits not in (None, 4, 8):
            raise ValueError(f"Translators are quantized to 8 or 4 bits, not {bits!r}.")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        metadata = {METADATA_KEY: self.spec.to_json()}
        arrays = {}
        for name, w in tree_flatten(self.parameters()):
            if bits and _quantizable(w.shape):
                wq, scales, biases = mx.quantize(w.astype(mx.float32), group_size=QUANT_GROUP,
                                                 bits=bits)
                stem = name[: -len("weight")]
                arrays.update({name: wq, stem + "scales": scales.astype(dtype),
                               stem + "biases": biases.astype(dtype)})
            else:
                arrays[name] = w.astype(dtype)
        if bits:
            metadata[QUANT_KEY] = json.dumps({"bits": bits, "group_size": QUANT_GROUP})
        save_safetensors_atomic(path, arrays, metadata)


def _quantizable(shape) -> bool:
    return len(shape) == 2 and shape[-1] % QUANT_GROUP == 0


def _last_rows(x: mx.array, keep: Optional[List], layer: int) -> mx.array:
    """The positions (axis 1) of ``x`` that target layer ``layer`` is mapped over."""
    n = keep[layer] if keep else None
    return x[:, -n:] if n else x


def _concat(xs: List[mx.array]) -> mx.array:
    return xs[0] if len(xs) == 1 else mx.concatenate(xs, axis=-1)


def _geometry_differences(role: str, want: CacheGeometry, have: CacheGeometry):
    """Human-readable differences between the geometry a translator expects and a model's."""
    out = []
    if want.model_type != have.model_type:
        out.append(f"{role} model_type: translator {want.model_type}, model {have.model_type}")
    if want.n_layers != have.n_layers:
        out.append(f"{role} layers: translator {want.n_layers}, model {have.n_layers}")
        return out
    for i, (a, b) in enumerate(zip(want.layers, have.layers)):
        for name in ("n_kv_heads", "head_dim", "window", "rope"):
            va, vb = getattr(a, name), getattr(b, name)
            if va != vb:
                out.append(f"{role} layer {i} {name}: translator {va}, model {vb}")
    return out


# ---------------------------------------------------------------------------
# Loading


def rewrite_spec(path, out, spec: TranslatorSpec) -> None:
    """Write translator file ``path``'s tensors, byte for byte, to ``out`` (atomically;
    it may be ``path``) under ``spec``: a new default, not new maps. The spec's own
    fields are checked here; that it describes these tensors, only by loading the
    result (load_translator), which callers do."""
    _validate_spec(spec)
    arrays, metadata = mx.load(str(path), return_metadata=True)
    metadata[METADATA_KEY] = spec.to_json()
    save_safetensors_atomic(out, arrays, metadata)


def load_translator(path) -> Translator:
    """Read a translator file (or a hub repo id holding one), checking its header,
    metadata, shapes and values."""
    path = resolve_translator(path)
    if not path.is_file():
        raise TranslatorFileError(f"Translator file not found: {path}")
    header = read_safetensors_header(path)
    meta = header.get("__metadata__") or {}
    if METADATA_KEY not in meta:
        raise TranslatorFileError(
            f"{path} is a safetensors file but not an mlx-kvlingo translator "
            f"(no '{METADATA_KEY}' metadata)."
        )
    try:
        spec = TranslatorSpec.from_json(meta[METADATA_KEY])
        _validate_spec(spec)
        translator = Translator(spec)
    except TranslatorFileError as e:
        raise TranslatorFileError(f"{path}: {e}") from e
    except Exception as e:  # any malformed JSON structure
        raise TranslatorFileError(f"{path}: damaged translator metadata ({e!r}).") from e
    expected = dict(tree_flatten(translator.parameters()))
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    bits = file_quantization(path, meta)
    layout = _file_layout(expected, bits)
    if set(tensors) != set(layout):
        missing = sorted(set(layout) - set(tensors))
        extra = sorted(set(tensors) - set(layout))
        raise TranslatorFileError(
            f"{path}: tensors do not match the metadata (missing {missing[:4]}, "
            f"unexpected {extra[:4]})."
        )
    # All floating tensors in float32, or all in float16 (shipped translators: half
    # the size); quantized weights are packed uint32.
    floats = [tensors[n].get("dtype") for n, (kind, _) in layout.items() if kind == "float"]
    want = floats[0] if floats and floats[0] in ("F32", "F16") and len(set(floats)) == 1 else "F32"
    for name, (kind, shape) in layout.items():
        info = tensors[name]
        dtype = "U32" if kind == "packed" else want
        if info.get("dtype") != dtype or list(info.get("shape", [])) != list(shape):
            raise TranslatorFileError(
                f"{path}: tensor {name} is {info.get('dtype')} {info.get('shape')}, "
                f"expected {dtype} {list(shape)}."
            )
    try:
        arrays = mx.load(str(path), format="safetensors")
    except Exception as e:
        raise TranslatorFileError(f"{path}: could not read tensors ({e}).") from e
    for name, a in arrays.items():
        if layout[name][0] == "float" and not mx.all(mx.isfinite(a)).item():
            raise TranslatorFileError(f"{path}: tensor {name} contains NaN or inf.")
    arrays = _dequantize(arrays, expected, bits)
    translator.load_weights([(k, v.astype(mx.float32)) for k, v in arrays.items()])
    mx.eval(translator.parameters())
    return translator


def file_quantization(path, meta) -> Optional[int]:
    """The bits of a quantized file (None: plain float)."""
    if QUANT_KEY not in meta:
        return None
    try:
        q = json.loads(meta[QUANT_KEY])
        ok = q["bits"] in (4, 8) and q["group_size"] == QUANT_GROUP
    except (ValueError, TypeError, KeyError):
        ok = False
    if not ok:
        raise TranslatorFileError(f"{path}: unsupported quantization {meta[QUANT_KEY]!r}.")
    return q["bits"]


def _file_layout(expected: dict, bits: Optional[int]) -> dict:
    """Each tensor a file must hold: name -> (kind, shape), kind "float" or "packed"."""
    layout = {}
    for name, w in expected.items():
        out, width = w.shape
        if bits and _quantizable(w.shape):
            stem = name[: -len("weight")]
            layout[name] = ("packed", (out, width * bits // 32))
            layout[stem + "scales"] = layout[stem + "biases"] = ("float", (out, width // QUANT_GROUP))
        else:
            layout[name] = ("float", tuple(w.shape))
    return layout


def _dequantize(arrays: dict, expected: dict, bits: Optional[int]) -> dict:
    out = {}
    for name, w in expected.items():
        if bits and _quantizable(w.shape):
            stem = name[: -len("weight")]
            scales = arrays[stem + "scales"].astype(mx.float32)
            biases = arrays[stem + "biases"].astype(mx.float32)
            out[name] = mx.dequantize(arrays[name], scales, biases, group_size=QUANT_GROUP,
                                      bits=bits)
        else:
            out[name] = arrays[name]
    return out


def _is_count(x, minimum=0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= minimum


def _validate_spec(spec: TranslatorSpec):
    """Refuse metadata that would load but translate wrongly."""
    if not _is_count(spec.format_version, 1):
        raise TranslatorFileError(f"invalid format_version {spec.format_version!r}.")
    if spec.format_version > FORMAT_VERSION:
        raise TranslatorFileError(
            f"format version {spec.format_version}; this mlx-kvlingo reads up to "
            f"{FORMAT_VERSION}. Upgrade mlx-kvlingo."
        )
    if spec.alignment not in ALIGNMENTS:
        raise TranslatorFileError(f"unknown alignment {spec.alignment!r}.")
    if not _is_count(spec.native_prefix):
        raise TranslatorFileError(f"invalid native_prefix {spec.native_prefix!r}.")
    if not _is_count(spec.native_tail):
        raise TranslatorFileError(f"invalid native_tail {spec.native_tail!r}.")
    if not (isinstance(spec.recompute, (int, float)) and not isinstance(spec.recompute, bool)
            and 0 <= spec.recompute <= 1 and _is_count(spec.recompute_max)
            and _is_count(spec.recompute_reserve)
            and spec.recompute_select in ("question", "question-words", "source", "lexical")):
        raise TranslatorFileError(
            f"invalid recompute {spec.recompute!r} / recompute_max {spec.recompute_max!r} / "
            f"recompute_reserve {spec.recompute_reserve!r}.")
    if not _is_count(spec.break_even):
        raise TranslatorFileError(f"invalid break_even {spec.break_even!r}.")
    if not isinstance(spec.native_layer0, bool):
        raise TranslatorFileError(f"invalid native_layer0 {spec.native_layer0!r}.")
    for role in ("source", "target"):
        layers = getattr(spec, role).geometry["layers"]
        if not layers or not all(
            _is_count(lg["n_kv_heads"], 1) and _is_count(lg["head_dim"], 1)
            for lg in layers
        ):
            raise TranslatorFileError(f"invalid {role} geometry.")
    n_target = len(spec.target.geometry["layers"])
    if not (_is_count(spec.token_width) and isinstance(spec.token_layers, list)
            and all(_is_count(i) and i < n_target for i in spec.token_layers)
            and len(set(spec.token_layers)) == len(spec.token_layers)
            and (spec.token_width > 0 or not spec.token_layers)):
        raise TranslatorFileError(
            f"invalid token_layers {spec.token_layers!r} / token_width {spec.token_width!r}.")
    rank = spec.shared_rank
    if not (isinstance(rank, dict) and (not rank or (set(rank) == {"k", "v"} and all(
            _is_count(r, 1) for r in rank.values())))):
        raise TranslatorFileError(f"invalid shared_rank {rank!r}.")
    if not isinstance(spec.shared_tokens, bool) or (spec.shared_tokens and not (
            rank and spec.token_layers)):
        raise TranslatorFileError(f"invalid shared_tokens {spec.shared_tokens!r}.")
    n_source = len(spec.source.geometry["layers"])
    for i, layers in enumerate(spec.layer_map):
        if not layers or not all(_is_count(j) and j < n_source for j in layers):
            raise TranslatorFileError(
                f"layer_map entry {i} ({layers!r}) must list source layers in 0..{n_source - 1}."
            )


_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I32": 4, "I64": 8, "U8": 1,
                "U32": 4}


def read_safetensors_header(path: Path) -> dict:
    """Parse and validate a safetensors header without trusting it."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise TranslatorFileError(f"{path}: truncated (no safetensors header).")
        (n,) = struct.unpack("<Q", head)
        if n == 0 or n > min(size - 8, 100 * 2**20):
            raise TranslatorFileError(f"{path}: not a safetensors file (bad header size).")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise TranslatorFileError(f"{path}: damaged safetensors header ({e}).") from e
    if not isinstance(header, dict):
        raise TranslatorFileError(f"{path}: damaged safetensors header.")
    data_size = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            if info is None:  # mlx writes null when a file has no metadata
                continue
            if not isinstance(info, dict) or not all(
                isinstance(v, str) for v in info.values()
            ):
                raise TranslatorFileError(f"{path}: damaged safetensors metadata.")
            continue
        try:
            begin, end = info["data_offsets"]
            count = math.prod(info["shape"]) * _DTYPE_BYTES[info["dtype"]]
            ok = 0 <= begin <= end <= data_size and end - begin == count
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise TranslatorFileError(
                f"{path}: tensor {name!r} has an invalid entry in the header "
                "(truncated or altered file)."
            )
    return header
