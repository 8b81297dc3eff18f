"""GGUF import: llama.cpp model files as mlx-lm models and tokenizers.

A GGUF file holds a model's config as metadata, its tokenizer as metadata, and its
weights as blocks of llama.cpp quantization types. This module reads a file with
``gguf.GGUFReader`` (``mx.load`` cannot read K-quants) and

- repacks every Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K block into MLX affine
  quantization at group size 32 (``w = scale * q + bias``; the 32-element groups of
  these types map one to one onto MLX groups), exactly: dequantizing the result
  gives the same floats as llama.cpp's (and the ``gguf`` package's) dequantizer;
- dequantizes Q6_K (16-element sub-blocks: no exact MLX layout), F16 and BF16;
- renames ``blk.N.*`` tensors to mlx-lm names and undoes llama.cpp's conventions:
  llama's Q and K rows are permuted for its rope layout (un-permuted here: weight,
  scales and biases alike), gemma3 stores every norm weight as ``w + 1`` (1 is
  subtracted here; mlx-lm's gemma RMSNorm adds it back); qwen2 is stored as it is
  (llama.cpp permutes only llama-architecture Q/K rows), Q/K/V biases included;
- rebuilds the Hugging Face tokenizer from the metadata, chat template included.

The result is either a model in memory (``load_gguf``) or an mlx-lm directory that
``mlx_lm.load`` and ``mlx_kvlingo.models.load`` open (``convert_gguf``). MLX's CPU
quantized matmul is slow, so both dequantize to float32 by default; pass
``dequantize=False`` to keep the MLX quantization (Metal / CUDA).
"""

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import KvlingoError
from .geometry import check_supported

GROUP_SIZE = 32  # MLX group size every repacked type maps onto
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma3")


def _gguf_package():
    """The `gguf` package (llama.cpp's Python reader), with an install hint if missing."""
    try:
        import gguf
    except ImportError as e:
        raise KvlingoError("Reading GGUF files needs the `gguf` package: pip install gguf") from e
    return gguf


def _ggml_types():
    return _gguf_package().GGMLQuantizationType


# ---------------------------------------------------------------------------
# Reading


def read_gguf(path: Union[str, Path]):
    """Open a GGUF file with ``gguf.GGUFReader``; damaged files raise KvlingoError."""
    GGUFReader = _gguf_package().GGUFReader
    path = Path(path)
    if not path.exists():
        raise KvlingoError(f"GGUF file {path} does not exist.")
    if not path.is_file():
        raise KvlingoError(f"{path} is not a file (expected a .gguf file).")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise KvlingoError(f"{path} is not a GGUF file (it does not start with 'GGUF').")
    try:
        return GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors ...
        raise KvlingoError(
            f"{path} could not be read as GGUF ({type(e).__name__}: {e}); the file is "
            "damaged or truncated."
        ) from e


_MISSING = object()


def gguf_architecture(path: Union[str, Path]) -> str:
    """``general.architecture`` of a GGUF file (its magic and metadata checked on the way)."""
    return _meta(read_gguf(path), "general.architecture")


def _meta(reader, key: str, default=_MISSING):
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise KvlingoError(f"The GGUF metadata has no {key!r}.")
        return default
    return field.contents()


def _tensor_shape(tensor) -> Tuple[int, ...]:
    """Logical shape in row-major (numpy / MLX) order: ggml lists dimensions the other way."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


# ---------------------------------------------------------------------------
# Repacking llama.cpp blocks into MLX affine quantization


@dataclass
class Affine:
    """An MLX affine-quantized matrix: ``weight`` packs ``bits``-bit integers into
    uint32 along each row; ``scales`` and ``biases`` hold one value per 32 columns."""

    weight: np.ndarray  # uint32 [rows, cols * bits / 32]
    scales: np.ndarray  # float32 [rows, cols / 32]
    biases: np.ndarray  # float32 [rows, cols / 32]
    bits: int

    def dequantize(self) -> mx.array:
        return mx.dequantize(
            mx.array(self.weight), mx.array(self.scales), mx.array(self.biases),
            group_size=GROUP_SIZE, bits=self.bits,
        )

    def take_rows(self, order: np.ndarray) -> "Affine":
        return Affine(self.weight[order], self.scales[order], self.biases[order], self.bits)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block, as float32 [n_blocks, 1]."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16).astype(np.float32)


def _u32(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, start : start + 4]).view("<u4")


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """Q4_0/Q4_1/Q5_x low bits: byte j holds element j (low nibble) and j + 16 (high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 fifth bits: bit j of a little-endian uint32 belongs to element j."""
    return ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scale_min(scales: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins packed into 12 bytes (Q4_K, Q5_K)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K low bits: each 32 bytes hold two sub-blocks, low nibbles first."""
    qs = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)


# Each unpacker maps blocks [n, type_size] (uint8) to (q [n, block] uint8 in element
# order, scales [n, block/32], biases [n, block/32]) with w = scale * q + bias.


def _q4_0(b):
    d = _f16(b, 0)
    return _nibbles_32(b[:, 2:18]), d, -8 * d


def _q4_1(b):
    return _nibbles_32(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _q5_0(b):
    d = _f16(b, 0)
    q = _nibbles_32(b[:, 6:22]) | (_high_bits_32(_u32(b, 2)) << 4)
    return q, d, -16 * d


def _q5_1(b):
    q = _nibbles_32(b[:, 8:24]) | (_high_bits_32(_u32(b, 4)) << 4)
    return q, _f16(b, 0), _f16(b, 2)


def _q8_0(b):
    # int8 v stored as byte v & 0xFF; v + 128 is that byte with its top bit flipped.
    d = _f16(b, 0)
    return b[:, 2:34] ^ np.uint8(0x80), d, -128 * d


def _q4_k(b):
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    return _k_nibbles(b[:, 16:144]).reshape(-1, 256), d * sc, -(dmin * mn)


def _q5_k(b):
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    qh = b[:, 16:48]  # bit i of byte j: element j of sub-block i
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q = _k_nibbles(b[:, 48:176]) | (high << 4)
    return q.reshape(-1, 256), d * sc, -(dmin * mn)


def _repackers():
    T = _ggml_types()
    return {
        T.Q4_0: (4, _q4_0),
        T.Q4_1: (4, _q4_1),
        T.Q5_0: (5, _q5_0),
        T.Q5_1: (5, _q5_1),
        T.Q8_0: (8, _q8_0),
        T.Q4_K: (4, _q4_k),
        T.Q5_K: (5, _q5_k),
    }


def _dequantized_types():
    T = _ggml_types()
    return (T.F32, T.F16, T.BF16, T.Q6_K)


def supported_types():
    """Names of the GGUF tensor types this module reads."""
    return sorted(t.name for t in list(_repackers()) + list(_dequantized_types()))


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack integers q [rows, cols] (each < 2**bits) the way MLX's affine quantization
    does: a little-endian bit stream per row, element i at bits [i*bits, (i+1)*bits)."""
    rows, cols = q.shape
    q = np.ascontiguousarray(q, dtype=np.uint8)
    if bits == 8:
        return q.view("<u4")
    if bits == 4:
        return np.ascontiguousarray(q[:, 0::2] | (q[:, 1::2] << 4)).view("<u4")
    out = np.empty((rows, cols * bits // 32), dtype="<u4")
    shifts = np.arange(bits, dtype=np.uint8)
    step = max(1, (1 << 22) // max(cols, 1))  # bound the bit-plane temporary
    for r in range(0, rows, step):
        planes = (q[r : r + step, :, None] >> shifts) & 1
        packed = np.packbits(planes.reshape(planes.shape[0], -1), axis=-1, bitorder="little")
        out[r : r + step] = packed.view("<u4")
    return out


def repack(data: np.ndarray, qtype, shape: Tuple[int, ...]) -> Union[Affine, np.ndarray]:
    """Convert one tensor's raw GGUF data to an ``Affine`` (repackable types) or a
    float32 array (F32, F16, BF16, Q6_K). ``shape`` is the logical row-major shape."""
    gguf = _gguf_package()
    T = gguf.GGMLQuantizationType
    qtype = T(qtype)
    repackers = _repackers()
    if qtype in repackers and len(shape) == 2:
        bits, unpack = repackers[qtype]
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        rows, cols = shape
        blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, type_size)
        if blocks.shape[0] * block_size != rows * cols:
            raise KvlingoError(f"{qtype.name} data does not match shape {shape}.")
        q, scales, biases = unpack(blocks)
        groups = (rows, cols // GROUP_SIZE)
        return Affine(
            weight=pack_bits(q.reshape(rows, cols), bits),
            scales=np.ascontiguousarray(scales, dtype=np.float32).reshape(groups),
            biases=np.ascontiguousarray(biases, dtype=np.float32).reshape(groups),
            bits=bits,
        )
    if qtype == T.F32:
        return np.ascontiguousarray(data).view(np.float32).reshape(shape)
    if qtype in repackers or qtype in _dequantized_types():
        return gguf.quants.dequantize(np.ascontiguousarray(data), qtype).reshape(shape)
    raise KvlingoError(
        f"GGUF tensor type {qtype.name} is not supported; supported: "
        f"{', '.join(supported_types())}."
    )


# ---------------------------------------------------------------------------
# llama.cpp conventions


def unpermute_rows(x, n_heads: int):
    """Undo llama.cpp's rope permutation of llama Q/K rows (and their biases).

    llama.cpp's converter interleaves each head's two rotation halves:
    ``w.reshape(n_heads, 2, head_dim // 2, ...).swapaxes(1, 2)``. This is its inverse.
    Works on any array whose first axis is the output rows.
    """
    rows = x.shape[0]
    if rows % (2 * n_heads):
        raise KvlingoError(f"Cannot un-permute {rows} rows into {n_heads} heads.")
    return x.reshape(n_heads, rows // n_heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _row_order(rows: int, n_heads: int) -> np.ndarray:
    return unpermute_rows(np.arange(rows), n_heads)


# Tensor names: llama.cpp's -> mlx-lm's. Layer tensors are blk.N.<name>.{weight,bias}.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}
_ARCH_LAYER_NAMES = {
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "qwen2": {"ffn_norm": "post_attention_layernorm"},
    "gemma3": {
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}


def mlx_name(gguf_name: str, arch: str) -> str:
    """The mlx-lm parameter name of a GGUF tensor."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[1].isdigit():
        table = dict(_LAYER_NAMES, **_ARCH_LAYER_NAMES[arch])
        if parts[2] in table:
            return f"model.layers.{parts[1]}.{table[parts[2]]}.{parts[3]}"
    elif len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    raise KvlingoError(f"GGUF tensor {gguf_name!r} has no counterpart in mlx-lm's {arch} model.")


# ---------------------------------------------------------------------------
# Config


def _f32_value(x) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.9999997e-06)."""
    return float(np.format_float_scientific(np.float32(x), unique=True))


def _scalar(reader, key, default=_MISSING):
    v = _meta(reader, key, default)
    if isinstance(v, list):
        if len(set(v)) != 1:
            raise KvlingoError(f"{key} differs between layers ({v}); this is not supported.")
        v = v[0]
    return v


def _rope_scaling(reader, arch) -> Optional[dict]:
    kind = _meta(reader, f"{arch}.rope.scaling.type", None)
    if kind in (None, "none"):
        return None
    if kind == "linear":
        factor = _f32_value(_meta(reader, f"{arch}.rope.scaling.factor"))
        return {"type": "linear", "factor": factor}
    raise KvlingoError(f"Rope scaling {kind!r} in a GGUF file is not supported (only linear).")


def _llama_config(reader, config: dict, names: set) -> dict:
    return dict(
        model_type="llama",
        rope_theta=_f32_value(_meta(reader, "llama.rope.freq_base", 10000.0)),
        attention_bias="blk.0.attn_q.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
    )


def _qwen2_config(reader, config: dict, names: set) -> dict:
    # mlx-lm's qwen2 derives head_dim from hidden / heads and always has Q/K/V biases.
    if config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]:
        raise KvlingoError(
            f"qwen2 with head_dim {config['head_dim']} x {config['num_attention_heads']} "
            f"heads != hidden size {config['hidden_size']} is not supported."
        )
    if not {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"} <= names:
        raise KvlingoError("The qwen2 GGUF file lacks the Q/K/V biases qwen2 attention has.")
    return dict(
        model_type="qwen2",
        rope_theta=_f32_value(_meta(reader, "qwen2.rope.freq_base", 1e6)),
    )


def _gemma3_config(reader, config: dict, names: set) -> dict:
    """gemma3, with the values llama.cpp hard-codes for it."""
    hidden, n_heads = config["hidden_size"], config["num_attention_heads"]
    return dict(
        model_type="gemma3_text",
        rope_theta=_f32_value(_meta(reader, "gemma3.rope.freq_base", 1e6)),
        rope_local_base_freq=10000.0,
        sliding_window=int(_meta(reader, "gemma3.attention.sliding_window")),
        sliding_window_pattern=6,
        # llama.cpp: 1/sqrt(head_dim), except Gemma 3 27B (62 layers): 1/sqrt(hidden/heads)
        query_pre_attn_scalar=(
            hidden // n_heads if config["num_hidden_layers"] == 62 else config["head_dim"]
        ),
    )


# The architecture-specific part of the config, from the shared part and the tensor names.
_ARCH_CONFIGS = {"llama": _llama_config, "qwen2": _qwen2_config, "gemma3": _gemma3_config}


def gguf_config(reader) -> dict:
    """The mlx-lm config.json dict for a GGUF file's metadata."""
    arch = _meta(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise KvlingoError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    names = {t.name for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise KvlingoError("The GGUF file has no token_embd.weight tensor.")
    if "rope_freqs.weight" in names:
        raise KvlingoError(
            "The GGUF file carries rope_freqs (Llama-3.1-style rope scaling), which is "
            "not supported yet."
        )
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    hidden = int(_meta(reader, f"{arch}.embedding_length"))
    n_heads = int(_scalar(reader, f"{arch}.attention.head_count"))
    n_kv = int(_scalar(reader, f"{arch}.attention.head_count_kv", n_heads))
    head_dim = int(_meta(reader, f"{arch}.attention.key_length", hidden // n_heads))
    if int(_meta(reader, f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise KvlingoError("Keys and values of different head sizes are not supported.")
    rope_dims = int(_meta(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise KvlingoError(
            f"Partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported."
        )
    config = dict(
        hidden_size=hidden,
        num_hidden_layers=int(_meta(reader, f"{arch}.block_count")),
        intermediate_size=int(_scalar(reader, f"{arch}.feed_forward_length")),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=_f32_value(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        vocab_size=int(_meta(reader, f"{arch}.vocab_size", _tensor_shape(embed)[0])),
        max_position_embeddings=int(_meta(reader, f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        rope_scaling=_rope_scaling(reader, arch),
    )
    config.update(_ARCH_CONFIGS[arch](reader, config, names))
    return {k: v for k, v in config.items() if v is not None}


# ---------------------------------------------------------------------------
# Weights


def _convert_tensor(tensor, arch: str, config: dict):
    """(mlx name, Affine or float32 array) for one GGUF tensor, conventions undone."""
    name = mlx_name(tensor.name, arch)
    value = repack(tensor.data, tensor.tensor_type, _tensor_shape(tensor))
    part = tensor.name.split(".")[-2]
    if arch == "llama" and part in ("attn_q", "attn_k"):
        heads = config["num_attention_heads" if part == "attn_q" else "num_key_value_heads"]
        rows = value.weight.shape[0] if isinstance(value, Affine) else value.shape[0]
        order = _row_order(rows, heads)
        value = value.take_rows(order) if isinstance(value, Affine) else value[order]
    if arch == "gemma3" and part.endswith("norm"):
        value = value - np.float32(1.0)  # GGUF stores w + 1
    return name, value


def gguf_weights(
    reader,
    dequantize: bool = True,
    dtype: mx.Dtype = mx.float32,
    log: Optional[Callable[[str], None]] = None,
) -> Tuple[dict, Dict[str, mx.array]]:
    """(mlx-lm config, weights) of an open GGUF file.

    ``dequantize``: every weight as a dense ``dtype`` array; otherwise repackable
    matrices stay MLX-quantized (bits 4, 5 or 8 at group size 32, scales and biases in
    ``dtype``) and the config says so per layer, as mlx-lm's quantized models do.
    """
    config = gguf_config(reader)
    arch = _meta(reader, "general.architecture")
    weights: Dict[str, mx.array] = {}
    quantized: Dict[str, int] = {}
    t0 = time.perf_counter()
    for i, tensor in enumerate(reader.tensors):
        name, value = _convert_tensor(tensor, arch, config)
        if isinstance(value, Affine) and dequantize:
            new = {name: value.dequantize().astype(dtype)}
        elif isinstance(value, Affine):
            module = name.rsplit(".", 1)[0]
            new = {
                name: mx.array(value.weight),
                f"{module}.scales": mx.array(value.scales).astype(dtype),
                f"{module}.biases": mx.array(value.biases).astype(dtype),
            }
            quantized[module] = value.bits
        else:
            new = {name: mx.array(value).astype(dtype)}
        mx.eval(list(new.values()))
        weights.update(new)
        if log and (i + 1) % 50 == 0:
            log(f"  {i + 1}/{len(reader.tensors)} tensors ({time.perf_counter() - t0:.0f}s)")
    if quantized:
        default_bits = Counter(quantized.values()).most_common(1)[0][0]
        q = {"group_size": GROUP_SIZE, "bits": default_bits, "mode": "affine"}
        q.update({m: {"group_size": GROUP_SIZE, "bits": b} for m, b in sorted(quantized.items())})
        config["quantization"] = q
        config["quantization_config"] = q
    return config, weights


def build_model(config: dict, weights: Dict[str, mx.array]) -> nn.Module:
    """An mlx-lm model from a config and weights, the way ``mlx_lm.load`` builds it."""
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(dict(weights))
    quantization = config.get("quantization")
    if quantization:
        nn.quantize(
            model,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            class_predicate=lambda path, _: quantization.get(path, False),
        )
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise KvlingoError(f"The GGUF weights do not fit mlx-lm's model: {e}") from e
    mx.eval(model.parameters())
    model.eval()
    return model


# ---------------------------------------------------------------------------
# Tokenizer

_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def gguf_tokenizer(path: Union[str, Path], reader=None):
    """The Hugging Face tokenizer a GGUF file describes (chat template included).

    transformers 5's ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` reads the
    file with modules that need PyTorch. Where transformers has its GGUF tokenizer
    builders (``integrations.gguf.gguf_tokenizer_mapping``), the same builders are
    called here on the metadata ``gguf.GGUFReader`` read, with no PyTorch; otherwise
    AutoTokenizer is used. The tokenizer class is the generic fast tokenizer (Gemma's
    for sentencepiece Gemma vocabularies): ``tokenizer.json`` carries everything.
    """
    path = Path(path)
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:
        return _auto_tokenizer(path)
    reader = reader if reader is not None else read_gguf(path)
    metadata = {
        k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")
    }
    arch = _meta(reader, "general.architecture")
    grouped = {
        group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                if f"tokenizer.{key}" in metadata}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if "tokens" not in tokenizer_dict:
        raise KvlingoError(f"{path} carries no tokenizer (no tokenizer.ggml.tokens).")
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
        tokenizer_config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= token_id < len(tokenizer_dict["tokens"]):
            tokenizer_config[name] = tokenizer_dict["tokens"][token_id]
    try:
        backend, extra = convert_gguf_tokenizer(arch, tokenizer_dict)
    except Exception as e:
        raise KvlingoError(f"Could not build the tokenizer of {path}: {e}") from e
    tokenizer_config.update(extra)
    if arch.startswith("gemma") and tokenizer_dict.get("tokenizer_type") == "llama":
        from transformers import GemmaTokenizer as cls
    else:
        from transformers import PreTrainedTokenizerFast as cls
    return cls(tokenizer_object=backend, **tokenizer_config)


def _auto_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise KvlingoError(f"Could not build the tokenizer of {path}: {e}") from e


def _mlx_tokenizer(hf_tokenizer):
    """mlx-lm's TokenizerWrapper (with its streaming detokenizer) for a HF tokenizer."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        hf_tokenizer.save_pretrained(tmp)
        return load_tokenizer(Path(tmp))


# ---------------------------------------------------------------------------
# Public entry points


def _on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def load_gguf(
    path: Union[str, Path],
    dtype: Optional[mx.Dtype] = None,
    dequantize: Optional[bool] = None,
    log: Optional[Callable[[str], None]] = None,
):
    """Load a GGUF file into an mlx-lm model and tokenizer, in memory.

    ``dequantize``: dense weights (default on the CPU, where MLX's quantized matmul is
    slow) or MLX-quantized ones (default on Metal / CUDA). ``dtype``: the floating
    type of weights, scales and biases (default float32: exact for every type).
    """
    path = Path(path)
    dequantize = _on_cpu() if dequantize is None else dequantize
    reader = read_gguf(path)
    config, weights = gguf_weights(reader, dequantize, dtype or mx.float32, log)
    model = build_model(config, weights)
    model.name_or_path = str(path)
    check_supported(model)
    tokenizer = _mlx_tokenizer(gguf_tokenizer(path, reader))
    return model, tokenizer


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def sha256_file(path: Union[str, Path]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def convert_gguf(
    path: Union[str, Path],
    out_dir: Union[str, Path],
    dequantize: bool = True,
    dtype: mx.Dtype = mx.float32,
    overwrite: bool = False,
    log: Optional[Callable[[str], None]] = None,
) -> Path:
    """Convert a GGUF file into an mlx-lm model directory (config.json,
    model.safetensors, tokenizer files) that ``mlx_lm.load`` opens.

    The directory is written under a temporary name and renamed when complete.
    ``dequantize=False`` keeps MLX affine quantization (Q6_K tensors stay dense).
    """
    path, out_dir = Path(path), Path(out_dir)
    log = log or (lambda s: None)
    if out_dir.exists() and not overwrite:
        raise KvlingoError(f"{out_dir} already exists (pass overwrite=True to replace it).")
    t0 = time.perf_counter()
    reader = read_gguf(path)
    kind = str(dtype).replace("mlx.core.", "") if dequantize else "MLX-quantized"
    log(f"Converting {path.name} to an mlx-lm directory ({kind} weights) ...")
    config, weights = gguf_weights(reader, dequantize, dtype, log)
    config["gguf_source"] = {
        "file": path.name,
        "sha256": sha256_file(path),
        "dequantized": dequantize,
    }
    tokenizer = gguf_tokenizer(path, reader)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        del weights
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(str(tmp))
        if out_dir.exists() and overwrite:
            shutil.rmtree(out_dir)
        try:
            os.replace(tmp, out_dir)
        except OSError as e:  # another process finished first
            raise KvlingoError(f"Could not move the converted model to {out_dir}: {e}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"Wrote {out_dir} in {time.perf_counter() - t0:.1f}s")
    return out_dir
