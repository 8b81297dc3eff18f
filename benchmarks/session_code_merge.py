"""One table from a `session_code.py` run whose first chats predate the translator
file's present defaults and a `--switch-only` run of those chats with them.

The chats the switch-only run holds take its Session switch row; their one-shot
switch row, made with the earlier defaults, is dropped; every other row (the
re-prefill, the small model itself, the truncations) does not depend on the file
and is kept. Both runs must share --tokens, --kinds and --seed (their items match by
key). No model is loaded.

    python benchmarks/session_code_merge.py \\
        benchmarks/results/session-code-2026-12-06-2000-final.items.jsonl \\
        benchmarks/results/session-code-2026-12-07-2000-switch.items.jsonl \\
        --json benchmarks/results/session-code-2026-12-07-2000-merged.json
"""

import argparse
import json
from pathlib import Path

from session_code import SETTINGS, report  # this folder's

SESSION, ONE_SHOT = SETTINGS[0], SETTINGS[3]


def merged(full: list, switch_only: list) -> list:
    """The full run's rows, with the switch-only run's Session switch where it has one."""
    again = {r["key"]: r for r in switch_only}
    rows = []
    for r in full:
        if r["key"] in again:
            r = {k: v for k, v in r.items() if k != ONE_SHOT}
            r[SESSION] = again[r["key"]][SESSION]
        rows.append(r)
    return rows


def read_rows(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("full", type=Path, help="the full run's checkpoint (.items.jsonl)")
    p.add_argument("switch_only", type=Path, help="the --switch-only run's checkpoint")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    report(merged(read_rows(args.full), read_rows(args.switch_only)), args)


if __name__ == "__main__":
    main()
