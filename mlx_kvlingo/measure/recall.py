"""Long-range recall after a switch, beside the alternatives a user has.

For each item (``data.recall``: a fact deep in the context, a cue at its end) the
target answers from four kinds of cache, all in one run:

- ``native``: the target re-prefills the whole context (the reference);
- ``switch``: the source read the context (not timed), its cache is translated
  and the target takes its first step (the native tail included);
- ``last N``: the target re-prefills only the last N context tokens, the older
  ones dropped, for fixed N and for the *equal-time* N, whose re-prefill takes
  as long as the switch did (interpolated from the fixed-N times of this run);
- ``none``: the target reads only the cue.

Per item and setting: exact match of the greedy answer, the answer's NLL per
token (teacher-forced), and the time to the first token. Every setting sees the
same items, so differences are paired.
"""

import hashlib
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..switching.gate import probe_facts
from ..data.recall import KINDS, PLAIN_KINDS, RecallItem, heldout_filler, recall_items
from ..metrics import log_softmax, nll
from ..models.cache import prefill
from ..models.load import load_pair
from ..progress import around_bars, bar
from ..switching.api import SwitchResult, switch, switch_text
from ..switching.recompute import merge_spans
from ..translator.align import tokenize_with_offsets
from ..translator.maps import Translator
from .bootstrap import Interval, mean_interval, paired_mean_difference

NATIVE, SWITCH, NONE, EQUAL_TIME = "native", "switch", "none", "equal-time"
ORACLE = "switch + recompute the fact (oracle)"
DEFAULT_RECOMPUTE = "switch + default recompute"  # the translator file's budget
DEFAULT_TRUNCATIONS = (16, 64, 128, 256)


@dataclass
class RecallScore:
    """One item under one setting."""

    exact: bool
    answer_nll: float  # mean over the answer's tokens, nats
    ttft_s: float  # to the first answer token
    said: str  # the greedy answer
    read: int  # context tokens in the cache the target answered from
    # A switch's fact probe (switching.gate.probe_facts: the mean NLL with which the
    # switched cache continues the context's most fact-like words), taken before
    # answering; None for other settings.
    probe: Optional[float] = None


@dataclass
class RecallResult:
    source: str
    target: str
    items: List[RecallItem]
    scores: Dict[str, List[RecallScore]]  # setting -> one score per item
    equal_time_tokens: Optional[int] = None
    notes: Dict[str, str] = field(default_factory=dict)

    def exact_rate(self, setting: str) -> Interval:
        return mean_interval([float(s.exact) for s in self.scores[setting]])

    def answer_nll(self, setting: str) -> Interval:
        return mean_interval([s.answer_nll for s in self.scores[setting]])

    def ttft(self, setting: str) -> float:
        return statistics.median(s.ttft_s for s in self.scores[setting])

    def exact_difference(self, a: str, b: str) -> Interval:
        """Exact-match rate of ``b`` minus ``a`` on the same items."""
        return paired_mean_difference([float(s.exact) for s in self.scores[a]],
                                      [float(s.exact) for s in self.scores[b]])

    def by_kind(self, setting: str) -> Dict[str, float]:
        """Exact-match rate per kind of fact."""
        out: Dict[str, List[bool]] = {}
        for item, s in zip(self.items, self.scores[setting]):
            out.setdefault(item.kind, []).append(s.exact)
        return {k: sum(v) / len(v) for k, v in out.items()}

    def nll_by_kind(self, setting: str) -> Dict[str, float]:
        """Mean answer NLL per token, per kind of fact."""
        out: Dict[str, List[float]] = {}
        for item, s in zip(self.items, self.scores[setting]):
            out.setdefault(item.kind, []).append(s.answer_nll)
        return {k: sum(v) / len(v) for k, v in out.items()}

    def to_dict(self) -> dict:
        return {
            "source": self.source, "target": self.target,
            "equal_time_tokens": self.equal_time_tokens, "notes": self.notes,
            "items": [i.to_dict() for i in self.items],
            "scores": {k: [asdict(s) for s in v] for k, v in self.scores.items()},
            "summary": {k: {"exact": self.exact_rate(k).to_dict(),
                            "answer_nll": self.answer_nll(k).to_dict(),
                            "ttft_s": self.ttft(k), "by_kind": self.by_kind(k),
                            "nll_by_kind": self.nll_by_kind(k)}
                        for k in self.scores},
        }


# ---------------------------------------------------------------------------
# One item


def answer_tokens(tokenizer, prompt_ids: List[int], prompt: str, answer: str) -> List[int]:
    """The answer's tokens as they follow the prompt (its own tokenization when the
    prompt's tokens are not a prefix of the whole text's)."""
    whole = tokenize_with_offsets(tokenizer, prompt + answer)[0]
    if whole[: len(prompt_ids)] == prompt_ids and len(whole) > len(prompt_ids):
        return whole[len(prompt_ids):]
    return tokenizer.encode(answer, add_special_tokens=False)


def matches(said: str, answer: str, plain: bool = False) -> bool:
    """The greedy text starts with the answer, and the answer is not the start of a
    longer word or number ("582" does not match "58213", "58213" not "582131").

    ``plain`` (an answer in ordinary lowercase words, ``data.recall.PLAIN_KINDS``):
    in any case and after any opening quote or emphasis, so that " Yes, he did"
    and ' "cellar"' match " yes" and " cellar"."""
    said, answer = said.lstrip(), answer.strip()
    if plain:
        said, answer = said.lstrip(" \t\n\"'*_`“‘").lower(), answer.lower()
    return said.startswith(answer) and not said[len(answer):len(answer) + 1].isalnum()


def score_state(target: nn.Module, tokenizer, state: SwitchResult, answer_ids: Sequence[int],
                answer: str, plain: bool = False,
                variants: Sequence[Sequence[int]] = ()) -> RecallScore:
    """Answer from ``state`` (a cache and the tokens the target still reads, ending
    with the cue's last; a deferred recompute is done in that first pass): the
    greedy answer, timed from ``state.translate_s`` seconds already spent, and the
    answer's teacher-forced NLL read on a copy of the state (``plain``: matched as
    :func:`matches` does plain answers). ``variants``: other spellings of the same
    answer (" Yes" for " yes"), each read on its own copy; the NLL is the likeliest
    spelling's."""
    forced = [state.copy() for _ in range(1 + len(variants))]
    read = state.context_length
    t0 = time.perf_counter()
    logits = state.read(target)[:, -1]
    token = int(mx.argmax(logits, axis=-1).item())
    ttft = state.translate_s + time.perf_counter() - t0
    said = [token]
    for _ in range(len(answer_ids) + 2):
        logits = target(mx.array([[said[-1]]]), cache=state.cache)[:, -1]
        said.append(int(mx.argmax(logits, axis=-1).item()))
    text = tokenizer.decode(said)
    nlls = []
    for copy, ids in zip(forced, [answer_ids, *variants]):
        lp = log_softmax(copy.read(target, ids[:-1], keep=len(ids)))
        nlls.append(nll(lp, mx.array([list(ids)])).mean().item())
    answer_nll = min(nlls)
    return RecallScore(matches(text, answer, plain), answer_nll, ttft, text, read)


def native_state(target: nn.Module, ids: Sequence[int]) -> SwitchResult:
    """The target's own cache of all but the last of ``ids`` (the last pending),
    timed."""
    t0 = time.perf_counter()
    cache = prefill(target, mx.array(ids[:-1]))
    mx.eval([(c.keys, c.values) for c in cache])
    return SwitchResult(cache, mx.array(list(ids[-1:])), time.perf_counter() - t0)


def truncated_ids(ids: Sequence[int], n: int, bos: Optional[int]) -> List[int]:
    """The last ``n`` context tokens, behind the BOS the model expects first."""
    tail = list(ids[-n:])
    if bos is not None and ids and ids[0] == bos and (not tail or tail[0] != bos):
        tail = [bos] + tail
    return tail


def read_source(source: nn.Module, source_tokenizer, translator: Translator, prompt: str):
    """What the source holds after reading ``prompt`` during its turn: (its cache,
    its tokens with offsets). A switch only reads the cache, so one serves many."""
    tokens = tokenize_with_offsets(source_tokenizer, prompt)
    ids = tokens[0] if translator.cross_tokenizer else tokens[0][:-1]
    cache = prefill(source, mx.array(ids))
    mx.eval([(c.keys, c.values) for c in cache])
    return cache, tokens


def switch_state(source: nn.Module, source_tokenizer, target: nn.Module, target_tokenizer,
                 translator: Translator, prompt: str, native_tail: Optional[int] = None,
                 read=None, recompute: Optional[float] = 0.0,
                 recompute_max: Optional[int] = 0, select: Optional[str] = None
                 ) -> SwitchResult:
    """The switch, from what the source holds (``read``, from :func:`read_source`;
    read now, not timed, when not given), recomputing exactly the budget given
    (None: the translator's default), chosen by ``select`` (None: the file's)."""
    source_cache, source_tokens = read or read_source(source, source_tokenizer, translator,
                                                      prompt)
    if translator.cross_tokenizer:
        return switch_text(source, source_tokenizer, target, target_tokenizer, translator,
                           prompt, source_cache, native_tail, source_tokens, recompute,
                           recompute_max, select=select)
    return switch(source, target, translator, source_tokens[0], source_cache, native_tail,
                  recompute, (prompt, source_tokens[1]), recompute_max, select=select)


def plain(item: RecallItem) -> bool:
    """Whether the item's answer is in ordinary words (matched in any case)."""
    return item.kind in PLAIN_KINDS


def answer_variants(tokenizer, prompt_ids: List[int], item: RecallItem) -> List[List[int]]:
    """Other spellings of the answer whose NLL counts as well: a yes/no answer after
    "Answer:" capitalized (" Yes", " No"), as models are wont to write it."""
    if item.kind != "yesno":
        return []
    return [answer_tokens(tokenizer, prompt_ids, item.prompt, " " + item.answer.strip().title())]


# ---------------------------------------------------------------------------
# A set of items


def equal_time_tokens(times: Dict[int, float], target_s: float) -> int:
    """The context length whose re-prefill takes ``target_s``, interpolated from
    measured (length, seconds) points (clamped to their range)."""
    ns = sorted(times)
    ts = [times[n] for n in ns]
    return int(round(float(np.interp(target_s, ts, ns))))


def fact_positions(item: RecallItem, offsets: Sequence[Tuple[int, int]]) -> List[int]:
    """Target positions of the item's fact sentences: where the item put it, which a
    real switch cannot know (the oracle a selection is measured against); every fact
    sentence of an item that has several."""
    return [i for i, (a, b) in enumerate(offsets)
            if any(b > start and a < end for start, end in item.facts)]


def recompute_setting(budget: Optional[float], most: int = 0,
                      select: Optional[str] = None) -> str:
    """A recompute setting's name (``budget`` None: the translator's default budget;
    ``select``: how its positions are chosen, None: the file's way)."""
    by = f" by {select}" if select else ""
    if budget is None:
        return DEFAULT_RECOMPUTE + by
    cap = f" (at most {most})" if most else ""
    return f"switch + recompute {budget:.0%}{cap}{by}"


# A run over many items takes long on a big target (a minute an item for a 1.5B on
# this CPU): each finished item's scores are appended to a JSON-lines file, and a
# rerun with the same file skips the items it holds.


def _item_key(item: RecallItem) -> str:
    return hashlib.sha256(json.dumps(item.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def load_checkpoint(path: Optional[Path], items: Sequence[RecallItem],
                    settings: Sequence[str]) -> Dict[int, Dict[str, RecallScore]]:
    """Item index -> its scores, for the items of ``path`` that are these very items
    scored under all of ``settings`` (the last line of an item wins; a line cut off
    by an interruption is ignored)."""
    if path is None or not Path(path).exists():
        return {}
    keys = {_item_key(item): i for i, item in enumerate(items)}
    done = {}
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        i = keys.get(row.get("key"))
        if i is not None and set(settings) <= set(row["scores"]):
            done[i] = {k: RecallScore(**v) for k, v in row["scores"].items()}
    return done


def save_item(path: Optional[Path], item: RecallItem, scores: Dict[str, RecallScore]):
    if path is None:
        return
    with open(path, "a") as f:
        f.write(json.dumps({"key": _item_key(item),
                            "scores": {k: asdict(v) for k, v in scores.items()}}) + "\n")


def measure_recall(
    source: nn.Module, source_tokenizer, target: nn.Module, target_tokenizer,
    translator: Translator, items: Sequence[RecallItem],
    truncations: Sequence[int] = DEFAULT_TRUNCATIONS, native_tail: Optional[int] = None,
    recompute: Sequence[Optional[float]] = (), oracle: bool = False,
    log: Callable[[str], None] = print, source_name: str = "source",
    target_name: str = "target", checkpoint: Optional[Union[str, Path]] = None,
    recompute_max: int = 0, selections: Sequence[Optional[str]] = (None,),
    progress: Optional[bool] = False,
) -> RecallResult:
    """Score every item under every setting (module docstring), items in order and
    settings interleaved per item so that the machine's load is shared alike.

    ``recompute``: budgets (fractions of the context) of switches whose fact-like
    words the target recomputes (``switching.recompute.salient_spans``), each at most
    ``recompute_max`` positions (0: no limit), each chosen in every way of
    ``selections`` (switching.api.SELECTIONS; None: the file's own); ``oracle``:
    also a switch that recomputes the item's fact sentence, which only the item
    knows. Each switch setting gets its own equal-time truncation.

    ``checkpoint``: a JSON-lines file each scored item is appended to; the items it
    already holds (same item, same settings) are not scored again. ``progress``: a
    bar over the items on standard error (None: when it is a terminal)."""
    bos = getattr(target_tokenizer, "bos_token_id", None)
    scores: Dict[str, List[RecallScore]] = {}

    def add(setting, score):
        scores.setdefault(setting, []).append(score)

    budgets = [(recompute_setting(b, recompute_max, sel), b, sel)
               for b in recompute for sel in selections]
    recomputed = [name for name, _, _ in budgets]
    switches = [SWITCH] + recomputed + ([ORACLE] if oracle else [])
    per_item = ([NATIVE] + switches + [f"last {n}" for n in truncations] + [NONE])
    done = load_checkpoint(checkpoint, items, per_item)
    if done:
        log(f"  {len(done)} of {len(items)} items already scored in {checkpoint}")
    prepared = []
    items_bar = bar(total=len(items), desc="recall items", progress=progress, unit="item")
    log = around_bars(log)
    for i, item in enumerate(items):
        items_bar.update(0 if i == 0 else 1)
        ids, offsets = tokenize_with_offsets(target_tokenizer, item.prompt)
        answer = answer_tokens(target_tokenizer, ids, item.prompt, item.answer)
        cue = len(target_tokenizer.encode(item.cue, add_special_tokens=False))
        variants = answer_variants(target_tokenizer, ids, item)
        prepared.append((ids, answer, variants))
        if i in done:
            for setting in per_item:
                add(setting, done[i][setting])
            continue
        add(NATIVE, score_state(target, target_tokenizer, native_state(target, ids), answer,
                                item.answer, plain(item), variants))
        read = read_source(source, source_tokenizer, translator, item.prompt)
        choices = [(SWITCH, 0.0, None, None)] + [(name, b, None, sel)
                                                 for name, b, sel in budgets]
        if oracle:
            choices.append((ORACLE, 0.0, lambda end: merge_spans(
                fact_positions(item, offsets), lo=translator.spec.native_prefix, hi=end),
                None))
        for setting, share, select, way in choices:
            state = switch_state(source, source_tokenizer, target, target_tokenizer,
                                 translator, item.prompt, native_tail, read, share,
                                 None if share is None else recompute_max, way)
            if select is not None:
                state.deferred = select(len(ids) - state.pending.size)
                state.context = list(ids)
            # The probe reads the cache as the answer will: recomputed, on a copy.
            probed = state.copy().prompt_cache
            probe = probe_facts(target, probed, ids, item.prompt, offsets,
                                lo=translator.spec.native_prefix)
            score = score_state(target, target_tokenizer, state, answer, item.answer,
                                plain(item), variants)
            score.probe = probe.nll if probe else None
            add(setting, score)
        for setting, n in [(f"last {n}", n) for n in truncations] + [(NONE, cue)]:
            add(setting, score_state(target, target_tokenizer,
                                     native_state(target, truncated_ids(ids, n, bos)), answer,
                                     item.answer, plain(item), variants))
        save_item(checkpoint, item, {k: scores[k][-1] for k in per_item})
        log(f"  item {i + 1}/{len(items)} ({item.kind}, {len(ids)} tokens): "
            + ", ".join(f"{k} {'+' if v[-1].exact else '-'}" for k, v in scores.items()))
    items_bar.update(1 if items else 0)
    items_bar.close()
    # The equal-time baselines: as many recent tokens as each switch's time allows.
    times = {n: statistics.median(s.ttft_s for s in scores[f"last {n}"]) for n in truncations}
    times[statistics.median(len(ids) for ids, _, _ in prepared)] = statistics.median(
        s.ttft_s for s in scores[NATIVE])
    equal = {}
    for setting in [SWITCH] + recomputed:
        n_eq = equal_time_tokens(times, statistics.median(s.ttft_s for s in scores[setting]))
        equal[setting] = n_eq
        name = EQUAL_TIME if setting == SWITCH else f"{EQUAL_TIME} ({setting})"
        for item, (ids, answer, variants) in zip(items, prepared):
            add(name, score_state(target, target_tokenizer,
                                  native_state(target, truncated_ids(ids, n_eq, bos)), answer,
                                  item.answer, plain(item), variants))
    return RecallResult(source_name, target_name, list(items), scores, equal[SWITCH],
                        {"equal_time_tokens": json.dumps(equal)})


def format_kinds(result: RecallResult) -> str:
    """A markdown table: exact match and answer NLL per kind, one row per setting."""
    kinds = list(dict.fromkeys(item.kind for item in result.items))
    counts = {k: sum(item.kind == k for item in result.items) for k in kinds}
    lines = ["| exact match / answer NLL | " + " | ".join(f"{k} ({counts[k]})" for k in kinds)
             + " |", "|---|" + "---|" * len(kinds)]
    for setting in result.scores:
        e, n = result.by_kind(setting), result.nll_by_kind(setting)
        lines.append(f"| {setting} | "
                     + " | ".join(f"{e[k]:.2f} / {n[k]:.2f}" for k in kinds) + " |")
    return "\n".join(lines)


def format_table(result: RecallResult) -> str:
    """A markdown table: one row per setting."""
    equal = ("" if result.equal_time_tokens is None
             else f" (equal time: the last {result.equal_time_tokens} tokens)")
    lines = [f"{result.source} -> {result.target}, {len(result.items)} items{equal}", "",
             "| setting | exact match [95% CI] | answer NLL [95% CI] | TTFT (median) |",
             "|---|---|---|---|"]
    for setting in result.scores:
        e, n = result.exact_rate(setting), result.answer_nll(setting)
        lines.append(f"| {setting} | {e.value:.2f} [{e.low:.2f}, {e.high:.2f}] | "
                     f"{n.value:.2f} [{n.low:.2f}, {n.high:.2f}] | "
                     f"{result.ttft(setting) * 1e3:.0f} ms |")
    return "\n".join(lines)


def run_recall(source: str, target: str, translator: Translator, tokens: int = 550,
               count: int = 48, kinds: Union[str, Sequence[str]] = KINDS,
               recompute: Sequence[float] = (),
               oracle: bool = False, native_tail: Optional[int] = None, seed: int = 0,
               log: Callable[[str], None] = print,
               checkpoint: Optional[Union[str, Path]] = None,
               recompute_max: int = 0, progress: Optional[bool] = False) -> RecallResult:
    """Load the two models and score ``count`` recall items of about ``tokens``
    target tokens, built from held-out text (``data.recall.heldout_filler``);
    ``progress`` as in :func:`measure_recall`."""
    src, src_tok, tgt, tgt_tok = load_pair(source, target, log=log)
    translator.check_models(src, tgt, src_tok, tgt_tok)
    items = recall_items(heldout_filler(), count, tokens, lambda text: len(tgt_tok.encode(text)),
                         kinds=kinds, seed=seed)
    return measure_recall(src, src_tok, tgt, tgt_tok, translator, items, native_tail=native_tail,
                          recompute=recompute, oracle=oracle, log=log, source_name=source,
                          target_name=target, checkpoint=checkpoint,
                          recompute_max=recompute_max, progress=progress)
