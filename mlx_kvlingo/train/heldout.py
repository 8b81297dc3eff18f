"""Translator files scored on a training corpus's held-out split (the documents
:func:`.samples.split_corpus` keeps out of training): what ``mlx-kvlingo eval``
measures and writes (NLLs, CBR with a bootstrap interval, KL, top-1 per context
length; every translator, native tail and layer-0 setting on the same windows)."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from ..errors import KvlingoError
from ..files import written_atomically
from ..measure.evaluate import Fidelity, evaluate_pair
from ..models.load import load_pair
from ..translator.maps import Translator, load_translator
from .samples import pair_data


def layer0_settings(option: str, translator: Translator) -> List[bool]:
    """The native-layer-0 settings to score a translator with: 'on', 'off', 'off,on'
    (both) or 'file' (as the file records)."""
    words = [w.strip() for w in option.split(",") if w.strip()]
    known = {"on": True, "off": False, "file": translator.spec.native_layer0}
    if not words or any(w not in known for w in words):
        raise KvlingoError(f"--native-layer0 takes on, off, off,on or file; got {option!r}.")
    return list(dict.fromkeys(known[w] for w in words))


@dataclass
class ScoredTranslator:
    """One translator file with one setting, scored at every context length."""

    path: Path
    translator: Translator
    native_tail: int
    rows: List[Fidelity]

    def title(self) -> str:
        layer0 = ", layer 0 native" if self.translator.spec.native_layer0 else ""
        return f"{self.path} (native tail {self.native_tail}{layer0})"

    def to_dict(self) -> dict:
        spec = self.translator.spec
        return {
            "translator": str(self.path), "training": spec.training,
            "native_tail": self.native_tail, "native_layer0": spec.native_layer0,
            "native_prefix": spec.native_prefix, "alignment": spec.alignment,
            "results": {str(f.context_len): f.to_dict() for f in self.rows},
        }


def evaluate_files(source: str, target: str, paths: Sequence[Path], corpus: str = "stdlib",
                   context_lengths: Sequence[int] = (128, 256), continuation_len: int = 64,
                   windows: int = 32, native_tails: Sequence[int] = (0,),
                   native_layer0: str = "file",
                   log: Callable[[str], None] = print,
                   progress: Optional[bool] = False) -> List[ScoredTranslator]:
    """Score translator files on ``corpus``'s held-out windows, each with every
    native tail and layer-0 setting, all on the same windows. ``progress``: a bar
    over each context length's windows on standard error (None: when it is a
    terminal)."""
    if not native_tails or min(native_tails) < 0:
        raise KvlingoError(f"--native-tail takes numbers >= 0, got {list(native_tails)!r}.")
    files, translators = [], []
    for p in paths:
        t = load_translator(p)
        for on in layer0_settings(native_layer0, t):
            files.append(p)
            translators.append(t.with_native_layer0(on))
    src, src_tok, tgt, tgt_tok = load_pair(source, target, log=log)
    for t in translators:
        t.check_models(src, tgt, src_tok, tgt_tok)
    pair = pair_data(corpus, src_tok, tgt_tok)
    # One row list per (translator, tail), in evaluate's translator-major order.
    rows = [[] for _ in translators for _ in native_tails]
    for c in context_lengths:
        items = pair.heldout(c, continuation_len, windows)
        scored = evaluate_pair(pair, src, tgt, translators, items, c, native_tails,
                               progress=progress)
        for r, f in zip(rows, scored):
            r.append(f)
        # Progress: a length of 48 windows takes tens of minutes on a small CPU.
        log(f"context {c}: {len(rows[0][-1].windows)} windows scored; CBR "
            + ", ".join(f"{r[-1].cbr:.1%}" for r in rows))
    n = len(native_tails)
    return [ScoredTranslator(files[i // n], translators[i // n], native_tails[i % n], r)
            for i, r in enumerate(rows)]


def write_report(path: Path, scored: Sequence[ScoredTranslator], **settings):
    """The JSON report of :func:`evaluate_files` (``settings``: source, target,
    corpus, continuation_len, windows), written atomically."""
    entries = [s.to_dict() for s in scored]
    report = dict(settings, translators=entries, results=entries[0]["results"])
    with written_atomically(path) as tmp:
        tmp.write_text(json.dumps(report, indent=2))
