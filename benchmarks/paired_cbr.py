"""CBR with its interval per translator, native tail and context of one
`mlx-kvlingo eval --json` report, and, for a report of two translators, the first
minus the second, paired (the same windows, resampled together).

    python benchmarks/paired_cbr.py REPORT.json
"""
import json
import sys

from mlx_kvlingo.evaluate import Fidelity, cbr_difference


def rows_of(report: dict) -> dict:
    """{(translator path, native tail, context): Fidelity}, in the report's order."""
    return {(e["translator"], e["native_tail"], ctx): Fidelity.from_dict(d)
            for e in report["translators"] for ctx, d in e["results"].items()}


def main(path: str):
    rows = rows_of(json.loads(open(path).read()))
    for (name, tail, ctx), f in rows.items():
        lo, hi = f.cbr_interval()
        print(f"{name:60s} tail {tail:>2} ctx {ctx:>5}: CBR {f.cbr:.1%} [{lo:.1%}, {hi:.1%}] "
              f"KL {f.kl:.3f} top1 {f.top1:.1%} n={len(f.windows)}")
    names = list(dict.fromkeys(k[0] for k in rows))
    if len(names) == 2:
        a, b = names
        for (name, tail, ctx), f in rows.items():
            if name == a:
                d, (lo, hi) = cbr_difference(f, rows[b, tail, ctx])
                print(f"first - second, tail {tail:>2}, ctx {ctx:>5}: {d * 100:+.1f} points "
                      f"[{lo * 100:+.1f}, {hi * 100:+.1f}]")


if __name__ == "__main__":
    main(sys.argv[1])
