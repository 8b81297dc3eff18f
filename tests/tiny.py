"""Tiny mlx-lm models built from config dicts, one per supported architecture."""

import mlx.core as mx
from mlx_lm.utils import _get_classes

BASE = dict(
    hidden_size=64,
    num_hidden_layers=4,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    vocab_size=97,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)

CONFIGS = {
    "qwen2": dict(BASE, model_type="qwen2", rope_theta=10000.0),
    "qwen3": dict(BASE, model_type="qwen3", head_dim=24, rope_theta=1e6),
    "llama": dict(BASE, model_type="llama", rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama_traditional": dict(BASE, model_type="llama", rope_traditional=True),
    "mistral": dict(BASE, model_type="mistral", num_key_value_heads=1, rope_theta=1e6),
    "gemma3_text": dict(BASE, model_type="gemma3_text", num_hidden_layers=6, head_dim=32,
                        num_key_value_heads=1, sliding_window=8, sliding_window_pattern=3,
                        query_pre_attn_scalar=32),
}


def tiny_model(name, seed=0, **overrides):
    config = dict(CONFIGS[name], **overrides)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    if hasattr(model, "sanitize"):
        model.sanitize({})  # e.g. gemma3 ties its LM head when it has no lm_head weight
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    model.name_or_path = f"tiny-{name}"
    return model


def identity_translator(model, source_tokenizer=None, target_tokenizer=None, scale=1.0,
                        native_prefix=1):
    """A translator from ``model`` to itself whose maps are ``scale`` times the
    identity: 1 is exact (a switch must change nothing), 0 carries nothing (every
    translated key and value is zero). Two different tokenizers make it a
    cross-tokenizer translator."""
    from mlx_kvlingo.translator.maps import Translator

    t = Translator.for_models(model, model, source_tokenizer,
                              target_tokenizer if target_tokenizer is not None else source_tokenizer,
                              native_prefix=native_prefix)
    assert t.spec.layer_map == [[i] for i in range(len(model.layers))]
    for m in t.k_maps + t.v_maps:
        m.weight = scale * mx.eye(m.weight.shape[0])
    mx.eval(t.parameters())
    return t


def native_greedy(model, tok, tokens, n):
    """The model's greedy continuation of ``tokens`` after a native prefill."""
    from mlx_lm.generate import stream_generate

    return [r.token for r in stream_generate(model, tok, mx.array(tokens), max_tokens=n)]


def user(text):
    """A user chat message."""
    return {"role": "user", "content": text}


# Recall items' filler text: plain sentences with nothing to remember.
FILLER = [" ".join(f"Sentence {i} of paragraph {p} says little of note." for i in range(12))
          for p in range(60)]
