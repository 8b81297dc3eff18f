"""mlx-kvlingo: translate one model's KV cache into another's, so a conversation
can switch models without re-prefilling its context."""

# Must come before anything imports mlx.core (see blas.py).
from . import blas as _blas

_blas.preload_openblas()

from .errors import KvlingoError, TranslatorMismatch  # noqa: E402
from .models import cache_geometry, load  # noqa: E402
from .translator import Translator, load_translator  # noqa: E402
from .switch import switch, switch_text, translate_context  # noqa: E402
from .session import Session  # noqa: E402
from .gate import QualityGate  # noqa: E402
from .conversations import ConversationStore  # noqa: E402
from .shipped import shipped_translator  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "ConversationStore",
    "KvlingoError",
    "QualityGate",
    "Session",
    "TranslatorMismatch",
    "Translator",
    "cache_geometry",
    "load",
    "load_translator",
    "shipped_translator",
    "switch",
    "switch_text",
    "translate_context",
]
