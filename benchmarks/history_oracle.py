"""Does a recompute older than Gemma 3's sliding window recover when the sliding
layers see the rows it looks back at? A diagnostic, not a method: the switch keeps
no translated rows before a sliding window, so there a recomputed span attends only
to itself; here the pass's by-position view (switching.recompute._by_position,
patched) gets the target's own rows for those positions instead (an oracle: an
upper bound for translating them). Recall items of ~1,100 tokens, SmolLM2 -> Gemma 3,
10 % recomputed, with and without the oracle rows; exact match per item (the NLL
column reads a copy of the cache without them).

    python benchmarks/history_oracle.py identifier,name TRANSLATOR.safetensors
"""
import mlx_kvlingo  # noqa
import sys
import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_kvlingo.switching import recompute as R
from mlx_kvlingo.data.recall import heldout_filler, recall_items
from mlx_kvlingo.measure.recall import read_source, switch_state, score_state, answer_tokens
from mlx_kvlingo.models.cache import prefill
from mlx_kvlingo.models.load import load_pair
from mlx_kvlingo.translator.align import tokenize_with_offsets
from mlx_kvlingo.translator.maps import load_translator

HIST = {}
orig = R._by_position
def patched(c, end, top):
    keys, values, held = orig(c, end, top)
    rows = HIST.get(id(c))
    first = R._first_held(c, end)
    if rows is not None and first:
        k, v = rows
        keys = mx.concatenate([k[..., :first, :].astype(keys.dtype), keys[..., first:, :]], axis=2)
        values = mx.concatenate([v[..., :first, :].astype(values.dtype), values[..., first:, :]], axis=2)
        held = held | (mx.arange(top) < first)
    return keys, values, held
R._by_position = patched

src, stok, tgt, ttok = load_pair("smollm2", "gemma3")
kinds = sys.argv[1].split(",")
t = load_translator(sys.argv[2])
items = [it for it in recall_items(heldout_filler(), 48, 1100, lambda x: len(ttok.encode(x)), seed=0) if it.kind in kinds]
# The oracle's rows: a prefill into plain caches, windowed by the mask (checked)
ids0 = tokenize_with_offsets(ttok, items[0].prompt)[0]
full = [KVCache() for _ in tgt.layers]
a = tgt(mx.array([ids0[:-1]]), cache=full)[:, -1]
norm = prefill(tgt, mx.array(ids0[:-2]))
bb = tgt(mx.array([ids0[-2:-1]]), cache=norm)[:, -1]
print("full-cache check", mx.abs(a - bb).max().item(), flush=True)
tot = {"plain": 0, "oracle history": 0}
for i, item in enumerate(items):
    ids, offsets = tokenize_with_offsets(ttok, item.prompt)
    answer = answer_tokens(ttok, ids, item.prompt, item.answer)
    read = read_source(src, stok, t, item.prompt)
    out = []
    for name in tot:
        HIST.clear()
        st = switch_state(src, stok, tgt, ttok, t, item.prompt, None, read, 0.1)
        if name != "plain":
            end = len(ids) - st.pending.size
            full = [KVCache() for _ in tgt.layers]
            tgt(mx.array([ids[:end]]), cache=full)
            for c, f in zip(st._cache, full):
                if isinstance(c, RotatingKVCache):
                    HIST[id(c)] = (f.keys[..., :end, :], f.values[..., :end, :])
        sc = score_state(tgt, ttok, st, answer, item.answer)
        tot[name] += sc.exact
        out.append(f"{name} {'+' if sc.exact else '-'} {sc.answer_nll:.2f}")
    print(i, item.kind, f"{item.depth:.2f}", " | ".join(out), flush=True)
print(tot, len(items))
