"""CBR with its interval per translator, tail and context of one `mlx-kvlingo eval
--json` report, and, for a report of two translators, their paired differences (the
same windows, resampled together).

    python benchmarks/paired_cbr.py REPORT.json
"""
import json, sys
from mlx_kvlingo.evaluate import Fidelity, cbr_difference
r = json.load(open(sys.argv[1]))
rows = {}
for e in r["translators"]:
    for c, d in e["results"].items():
        f = Fidelity.from_dict(d)
        rows[(e["translator"].split("/")[-1], e["native_tail"], c)] = f
        lo, hi = f.cbr_interval()
        print(f"{e['translator'].split('/')[-2]}/{e['translator'].split('/')[-1]:32s} tail {e['native_tail']:>2} ctx {c:>5}: CBR {f.cbr:.1%} [{lo:.1%}, {hi:.1%}] KL {d.get('kl', float('nan')):.3f} top1 {d.get('top1', float('nan')):.1%} n={len(f.windows)}")
names = sorted({k[0] for k in rows})
if len(names) == 2:
    a, b = names
    for (n, m, c), f in sorted(rows.items()):
        if n == a:
            d, (lo, hi) = cbr_difference(f, rows[(b, m, c)])
            print(f"{a} - {b}, tail {m}, ctx {c}: {d*100:+.1f} points [{lo*100:+.1f}, {hi*100:+.1f}]")
