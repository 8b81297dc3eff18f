"""Hand a conversation from one model to another without re-prefilling it.

Runs offline on the built-in pair: fits a stage-1 translator (a few seconds), lets the
source model read a context, switches the context to the target through the
translator and streams the target's continuation.

    python examples/switch_models.py
"""

import mlx_kvlingo as kv  # first: fast BLAS on Linux, before mlx.core

import mlx.core as mx

from mlx_kvlingo.data import corpus as data
from mlx_kvlingo.models.cache import prefill
from mlx_kvlingo.pairs import toy
from mlx_kvlingo.switching.api import switch
from mlx_kvlingo.switching.generate import generate_after_switch
from mlx_kvlingo.train.fit import fit_stage1

source_dir, target_dir = toy.ensure_toy_pair()
source, tokenizer = kv.load(source_dir)
target, target_tokenizer = kv.load(target_dir)

# Stage 1 on the standard library's docstrings (both models share the tokenizer).
train_docs, heldout_docs = data.split_documents(data.stdlib_documents())
translator = kv.Translator.for_models(source, target, tokenizer, target_tokenizer)
fit_stage1(source, target, translator,
           data.token_windows(data.token_stream(tokenizer, train_docs), 256, 8, 40))

# The source reads the context during its turn...
context = "Return a new list containing all items from the iterable in ascending order."
tokens = mx.array(tokenizer.encode(context))
source_cache = prefill(source, tokens[None, :-1])

# ...and the target takes over from the translated cache.
result = switch(source, target, translator, tokens, source_cache=source_cache)
print(f"translated {tokens.size - 1} tokens in {result.translate_s * 1e3:.1f} ms")
print(context, end="")
for response in generate_after_switch(target, target_tokenizer, result, max_tokens=40):
    print(response.text, end="", flush=True)
print()
