"""Pairs of models ready to switch between: the built-in pair (``toy``), stage-1
translators fitted on the spot (``builtin``) and the translators shipped for
SmolLM2-135M and Gemma 3 270M (``shipped``)."""
