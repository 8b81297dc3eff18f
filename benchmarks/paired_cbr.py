"""CBR with its interval per translator, native tail and context of `mlx-kvlingo eval
--json` reports, and the first translator minus each other one, paired (the same
windows, resampled together).

    python benchmarks/paired_cbr.py REPORT.json [OTHER.json]

With two reports (e.g. a new translator's eval and an earlier one of the shipped
file), their rows are merged; pairing needs the same windows, so both reports must
have been made with the same corpus, windows, lengths and continuation length.
"""
import json
import sys

from mlx_kvlingo.measure.evaluate import Fidelity, cbr_difference

# What makes two reports' windows the same ones.
SAME_WINDOWS = ("source", "target", "corpus", "continuation_len", "windows")


def rows_of(report: dict) -> dict:
    """{(translator path, native tail, context): Fidelity}, in the report's order."""
    return {(e["translator"], e["native_tail"], ctx): Fidelity.from_dict(d)
            for e in report["translators"] for ctx, d in e["results"].items()}


def merged_rows(reports: list) -> dict:
    first = reports[0]
    for other in reports[1:]:
        differ = [k for k in SAME_WINDOWS if other.get(k) != first.get(k)]
        if differ:
            sys.exit(f"The reports were not made on the same windows (they differ in {differ}).")
    rows = {}
    for report in reports:
        for key, f in rows_of(report).items():
            rows.setdefault(key, f)  # a translator in both reports: the first report's row
    return rows


def _same_windows(a: Fidelity, b: Fidelity) -> bool:
    """Identical windows give the same native (re-prefill) and no-context NLLs, up to
    float32 rounding: a window's NLL is a sum over its tokens (~100 nats), and another
    machine's BLAS kernels moved such sums by 1e-4 (relative 1e-6); other windows
    differ by whole nats."""
    def close(x, y):
        return abs(x - y) <= 1e-4 + 1e-5 * abs(y)

    return len(a.windows) == len(b.windows) and all(
        close(x["native"], y["native"]) and close(x["none"], y["none"])
        for x, y in zip(a.windows, b.windows))


def main(paths: list):
    rows = merged_rows([json.loads(open(p).read()) for p in paths])
    for (name, tail, ctx), f in rows.items():
        lo, hi = f.cbr_interval()
        print(f"{name:60s} tail {tail:>2} ctx {ctx:>5}: CBR {f.cbr:.1%} [{lo:.1%}, {hi:.1%}] "
              f"KL {f.kl:.3f} top1 {f.top1:.1%} n={len(f.windows)}")
    names = list(dict.fromkeys(k[0] for k in rows))
    a = names[0]
    for b in names[1:]:
        print(f"{a} minus {b}:")
        for (name, tail, ctx), f in rows.items():
            if name == a and (b, tail, ctx) in rows:
                g = rows[b, tail, ctx]
                if not _same_windows(f, g):
                    sys.exit(f"Tail {tail}, context {ctx}: the rows' native NLLs differ per "
                             "window, so they were not scored on the same windows.")
                d, (lo, hi) = cbr_difference(f, g)
                print(f"  tail {tail:>2}, ctx {ctx:>5}: {d * 100:+.1f} points "
                      f"[{lo * 100:+.1f}, {hi * 100:+.1f}]")


if __name__ == "__main__":
    if not 2 <= len(sys.argv) <= 3:
        sys.exit(__doc__)
    main(sys.argv[1:])
