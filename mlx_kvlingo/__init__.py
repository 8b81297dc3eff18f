"""mlx-kvlingo: translate one model's KV cache into another's, so a conversation
can switch models without re-prefilling its context.

The package is layered, each layer importing only from those below it:

- foundation: ``blas`` (fast BLAS, loaded before ``mlx.core``), ``errors``, ``progress``, ``plotting``,
  ``files``, ``cpu_math``, ``metrics``;
- ``models``: loading (mlx-lm directories, GGUF, models fetched from PyPI), cache
  geometry, rope in and out, reading and writing caches, features;
- ``data``: text corpora;
- ``translator``: the per-layer maps, their file format, token alignment, the hub;
- ``switching``: a switch (translate, then the target's first step), prompt-cache files;
- ``chat``: a conversation among models (Session), its catch-up and quality gate;
- ``measure``: fidelity, recall, multi-turn, time to first token;
- ``train``: stage 1 (closed form) and stage 2 (distillation);
- ``pairs``: the built-in pair, translators made on the spot, the shipped ones;
- ``serve``: the OpenAI-compatible server.
"""

# Must come before anything imports mlx.core (see blas.py).
from . import blas as _blas

_blas.preload_openblas()

from .switching.gate import QualityGate  # noqa: E402
from .chat.session import Session  # noqa: E402
from .errors import KvlingoError, TranslatorMismatch  # noqa: E402
from .models.cache import prefill  # noqa: E402
from .models.geometry import cache_geometry  # noqa: E402
from .models.load import load  # noqa: E402
from .pairs.shipped import load_shipped, shipped_translator  # noqa: E402
from .serve.conversations import ConversationStore  # noqa: E402
from .switching.api import SwitchResult, switch, switch_text, translate_context  # noqa: E402
from .switching.generate import generate_after_switch  # noqa: E402
from .translator.maps import Translator, load_translator  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "ConversationStore",
    "KvlingoError",
    "QualityGate",
    "Session",
    "SwitchResult",
    "TranslatorMismatch",
    "Translator",
    "cache_geometry",
    "generate_after_switch",
    "load",
    "load_shipped",
    "load_translator",
    "prefill",
    "shipped_translator",
    "switch",
    "switch_text",
    "translate_context",
]
