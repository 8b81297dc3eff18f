"""Measuring translators: fidelity on held-out text (``evaluate``, ``bootstrap``),
over conversations (``multiturn``), time to first token (``ttft``) and one switch
against a re-prefill (``compare``)."""
