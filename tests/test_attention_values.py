"""Value maps fitted against the target's own attention."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from tiny import CONFIGS, tiny_model

from mlx_kvlingo.models.cache import cache_features
from mlx_kvlingo.models.features import attention_weights
from mlx_kvlingo.train.fit import AttentionValueAccumulator, Moments, ridge_solve


class _Recorder(nn.Module):
    """Wraps a Linear and keeps its last input (the attention output per head)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.seen = None

    def __call__(self, x):
        self.seen = x
        return self.inner(x)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_attention_weights_reproduce_the_models_attention_output(arch):
    """Weights read off the model's own attention call, applied to the cached
    values, give exactly what the layer's attention passed to o_proj (so queries,
    norms, rope, scale, causal and sliding-window masks are all the model's)."""
    model = tiny_model(arch)
    tokens = mx.array([[5, 17, 3, 88, 41, 9, 23, 60, 2, 71, 33, 14, 50, 7]])
    recorders = []
    for layer in model.layers:
        rec = _Recorder(layer.self_attn.o_proj)
        layer.self_attn.o_proj = rec
        recorders.append(rec)
    cache, weights = attention_weights(model, tokens, per_head=True)
    _, values, _ = cache_features(model, cache)
    T = tokens.shape[1]
    for i, (w, rec) in enumerate(zip(weights, recorders)):
        B, H, L, S = w.shape
        assert (L, S) == (T, T)
        n_kv = model.layers[i].self_attn.n_kv_heads
        v = values[i].reshape(B, T, n_kv, -1).transpose(0, 2, 1, 3)  # [B, Hk, T, D]
        v = mx.repeat(v, H // n_kv, axis=1)
        out = (w @ v).transpose(0, 2, 1, 3).reshape(B, T, -1)
        np.testing.assert_allclose(np.array(out), np.array(rec.seen), atol=2e-5)
        # causal: nothing after the query; rows sum to one
        upper = np.triu(np.array(w[0, 0]), k=1)
        assert np.abs(upper).max() == 0.0
        np.testing.assert_allclose(np.array(w.sum(-1)), 1.0, atol=1e-5)
    if arch == "gemma3_text":  # a sliding layer attends to its last `window` positions only
        window = CONFIGS["gemma3_text"]["sliding_window"]
        w = np.array(weights[0][0, 0])
        assert np.abs(np.tril(w, k=-window)).max() == 0.0
        assert np.abs(np.tril(np.array(weights[2][0, 0]), k=-window)).max() > 0  # global


def test_mean_attention_is_the_head_mean():
    model = tiny_model("qwen3")
    tokens = mx.array([[1, 2, 3, 4, 5, 6, 7, 8]])
    _, per_head = attention_weights(model, tokens, per_head=True)
    _, mean = attention_weights(model, tokens)
    for a, b in zip(per_head, mean):
        np.testing.assert_allclose(np.array(a.mean(axis=1)), np.array(b), atol=1e-6)


def _direct_weighted_fit(x, v, a, ridge):
    """min_W |A (X Wᵀ - V)|² + λ|W|², solved directly with numpy."""
    p, r = a @ x, a @ v
    xtx = p.T @ p
    lam = ridge * np.trace(xtx) / len(xtx)
    return np.linalg.solve(xtx + lam * np.eye(len(xtx)), p.T @ r).T


def test_attention_value_fit_equals_a_direct_weighted_solve():
    rng = np.random.default_rng(0)
    T, w_in, w_out = 40, 6, 4
    windows = []
    for _ in range(3):
        x = rng.normal(size=(T, w_in)).astype(np.float32)
        v = (x @ rng.normal(size=(w_in, w_out)) + 0.3 * rng.normal(size=(T, w_out))).astype(np.float32)
        logits = rng.normal(size=(T, T))
        logits[np.triu_indices(T, 1)] = -np.inf
        a = np.exp(logits - logits.max(1, keepdims=True))
        a = (a / a.sum(1, keepdims=True)).astype(np.float32)
        windows.append((x, v, a))
    acc = AttentionValueAccumulator(layer_map=[[0]], widths=([w_in], [w_out]))
    for x, v, a in windows:
        acc.add([mx.array(x)[None]], [mx.array(v)[None]], [mx.array(a)[None]])
    (w, r2), = acc.solve(ridge=1e-3)
    x = np.concatenate([x for x, _, _ in windows])
    v = np.concatenate([v for _, v, _ in windows])
    # block-diagonal A over the windows: each window's queries see its own rows
    a = np.zeros((len(x), len(x)), np.float32)
    for n, (_, _, aw) in enumerate(windows):
        a[n * T:(n + 1) * T, n * T:(n + 1) * T] = aw
    np.testing.assert_allclose(w, _direct_weighted_fit(x, v, a, 1e-3), rtol=1e-4, atol=1e-5)
    assert 0 < r2 <= 1
    # With A the identity the fit is the plain least squares of values on features.
    eye = AttentionValueAccumulator(layer_map=[[0]], widths=([w_in], [w_out]))
    for x_, v_, _ in windows:
        eye.add([mx.array(x_)[None]], [mx.array(v_)[None]], [mx.eye(T)[None]])
    (w_eye, _), = eye.solve(ridge=1e-3)
    m = Moments.zeros(w_in, w_out)
    m.ytx, m.count = v.T.astype(np.float64) @ x, len(x)
    m.y_sum, m.y_sq = v.sum(0).astype(np.float64), (v.astype(np.float64) ** 2).sum(0)
    plain, _ = ridge_solve(x.T.astype(np.float64) @ x, m, 1e-3)
    np.testing.assert_allclose(w_eye, plain, rtol=1e-4, atol=1e-5)
