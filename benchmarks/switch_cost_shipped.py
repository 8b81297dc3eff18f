"""Switch cost of the shipped translators against earlier ones, interleaved in one process:
median time to first token after `switch_text` (translation, 16-token native tail, first
step) for each, and one re-prefill of the target, on Austen text.

    python benchmarks/switch_cost_shipped.py OLD_DIR [TOKENS [ROUNDS]]

OLD_DIR holds the earlier smollm2-to-gemma3 / gemma3-to-smollm2 .safetensors files (e.g.
`git show ddcbd2e~1:mlx_kvlingo/assets/translators/...`, the top-6 files).
"""
import mlx_kvlingo  # noqa
import json, statistics, sys, time
import mlx.core as mx
from mlx_kvlingo_cli.main import _load_pair
from mlx_kvlingo.align import tokenize_with_offsets
from mlx_kvlingo.models import prefill
from mlx_kvlingo.switch import switch_text, first_step
from mlx_kvlingo.translator import load_translator
from mlx_kvlingo import data

old_dir = sys.argv[1]
pairs = [("smollm2", "gemma3", f"{old_dir}/smollm2-to-gemma3.safetensors", "mlx_kvlingo/assets/translators/smollm2-to-gemma3.safetensors"),
         ("gemma3", "smollm2", f"{old_dir}/gemma3-to-smollm2.safetensors", "mlx_kvlingo/assets/translators/gemma3-to-smollm2.safetensors")]
n_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 4
out = {}
for s, t, old, new in pairs:
    src, stok, tgt, ttok = _load_pair(s, t)
    text = "\n\n".join(txt for _, txt in data.read_corpus("austen"))
    ids = ttok.encode(text[:n_tokens * 8])[:n_tokens]
    text = ttok.decode(ids)
    st = tokenize_with_offsets(stok, text)
    cache = prefill(src, mx.array(st[0])[None]); mx.eval([(c.keys, c.values) for c in cache])
    trs = {"previous, top-6": load_translator(old), "shipped now, top-18 (8-bit file)": load_translator(new)}
    times = {k: [] for k in trs}
    for r in range(rounds + 1):
        for name, tr in trs.items():
            t0 = time.perf_counter()
            res = switch_text(src, stok, tgt, ttok, tr, text, source_cache=cache, native_tail=16, source_tokens=st)
            mx.eval(first_step(tgt, res))
            if r:
                times[name].append(time.perf_counter() - t0)
    t0 = time.perf_counter(); c2 = prefill(tgt, mx.array(ttok.encode(text))[None]); mx.eval([(c.keys, c.values) for c in c2]); reprefill = time.perf_counter() - t0
    med = {k: statistics.median(v) for k, v in times.items()}
    out[f"{s}->{t}"] = {"tokens": n_tokens, "switch_s": med, "reprefill_s": reprefill,
                        "ratio_shipped_over_previous": med["shipped now, top-18 (8-bit file)"] / med["previous, top-6"]}
    print(json.dumps(out[f"{s}->{t}"]), flush=True)
json.dump(out, open("switch-cost-shipped.json", "w"), indent=1)
