"""A conversation among several models, each keeping its own KV cache.

- ``session``: :class:`Session`, the conversation and its turns;
- ``catch_up``: bringing a model's cache up to date with what others wrote;
- ``transcript``: who wrote which tokens, in each model's tokenization;
- ``turns``: per-turn reports and streams;
"""
