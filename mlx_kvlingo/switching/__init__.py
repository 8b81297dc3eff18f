"""A switch: the source's cache translated for the target, then the target's first
decoding step instead of a prefill.

- ``api``: :func:`switch`, :func:`switch_text` and the translate functions;
- ``kernel``: the translation itself, scheduled layer by layer;
- ``generate``: the first step and generation after a switch;
- ``prompt_cache``: mlx-lm prompt-cache files converted for another model;
- ``catch_up``: a switch onto a conversation's live cache;
- ``gate``: the quality gate that falls back to a re-prefill, and the fact probe;
- ``break_even``: below which length a switch does not pay.
"""

from .api import SwitchResult, switch, switch_text, translate_context
from .generate import first_step, generate_after_switch
