"""Long-range recall items and their scoring (data.recall, measure.recall)."""


import contextlib
import io
import re

import pytest
from tiny import FILLER, identity_translator, tiny_model

from mlx_kvlingo.data import recall as data_recall
from mlx_kvlingo.data.recall import (
    KIND_GROUPS,
    KINDS,
    PLAIN_KINDS,
    TEMPLATES,
    expand_kinds,
    recall_items,
)
from mlx_kvlingo.errors import KvlingoError
from mlx_kvlingo.measure.recall import (
    EQUAL_TIME,
    NATIVE,
    NONE,
    ORACLE,
    SWITCH,
    equal_time_tokens,
    fact_positions,
    format_kinds,
    format_table,
    matches,
    measure_recall,
    recompute_setting,
    truncated_ids,
)



def words(text):
    return len(text.split())


def test_items_hold_the_fact_at_its_depth_and_the_cue_never_says_the_answer():
    items = recall_items(FILLER, 24, 300, words, seed=3)
    assert {i.kind for i in items} == set(KINDS)
    for item in items:
        assert item.answer.strip() in item.context  # stated once, in the context
        assert item.answer.strip() not in item.cue
        assert item.context.count(item.answer.strip()) == 1
        assert words(item.prompt) <= 300
        at = item.context.index(item.answer.strip())
        start, end = item.fact
        assert start <= at < end and item.context[end - 1] == "."  # the value, in its sentence
        assert abs(at / len(item.context) - item.depth) < 0.3
    # Deterministic in the seed; another seed gives other values.
    assert recall_items(FILLER, 24, 300, words, seed=3) == items
    assert recall_items(FILLER, 24, 300, words, seed=4) != items


def test_every_kind_uses_several_phrasings():
    assert all(len(TEMPLATES[k]) >= 3 for k in KINDS)
    items = recall_items(FILLER, 64, 300, words, kinds=["number"], seed=0)
    assert len({i.template for i in items}) == len(TEMPLATES["number"])


# Python code filler for the code kind: small functions, blank lines between them.
CODE = ["\n\n".join(f"def step_{p}_{i}(value):\n    result = value + {i}\n"
                    f"    if result > {p}:\n        result -= {p}\n    return result"
                    for i in range(10)) for p in range(30)]


# Filler that mentions a third of every vocabulary's words, which an item must then
# leave out of its context.
NOISE = [w for v in ("_OBJECTS", "_PLACES", "_ROLES", "_CONTAINERS")
         for w in getattr(data_recall, v)[::3]]
NOISY = [f"{text} The {NOISE[i % len(NOISE)]} was seen once. Nobody spoke of the "
         f"{NOISE[(i * 7 + 3) % len(NOISE)]} again." for i, text in enumerate(FILLER * 2)]


def plain_items(count=60, depths=(0.05, 0.25, 0.5, 0.9), seed=3, kinds="plain", tokens=300):
    return recall_items(NOISY, count, tokens, words, kinds=kinds, depths=depths, seed=seed,
                        code_filler=CODE + [f"{w} = None  # the {w}" for w in
                                            data_recall._OBJECTS[::3]])


def said(word, text):
    return re.search(rf"(?<![A-Za-z]){re.escape(word)}(?![A-Za-z])", text, re.I) is not None


def test_plain_kinds_hold_ordinary_words_stated_only_in_the_fact():
    items = plain_items()
    assert [i.kind for i in items[:len(PLAIN_KINDS)]] == list(PLAIN_KINDS)
    for item in items:
        answer = item.answer.strip()
        assert item.answer.startswith(" ") and re.fullmatch(r"[a-z]+", answer), item.answer
        assert not said(answer, item.cue)  # the cue restates the subject, never the value
        assert words(item.prompt) <= 300
        if item.kind == "yesno":
            continue  # "yes" / "no": the context may say them anywhere
        # The answer is in the context, only in the fact sentence(s).
        where = [m.start() for m in re.finditer(rf"(?<![A-Za-z]){answer}(?![A-Za-z])",
                                                 item.context)]
        assert where and all(any(a <= w < b for a, b in item.facts) for w in where)
    # Deterministic in the seed; another seed gives other values.
    assert plain_items() == items
    assert plain_items(seed=4) != items


def test_the_combined_kind_needs_both_facts():
    items = plain_items(40, kinds=["combined"])
    for item in items:
        assert len(item.facts) == 2
        (a, b), (c, d) = item.facts
        # Apart: the second a good way on from the first (at the asked depth).
        assert c / len(item.context) - item.depth >= 0.25 * (1 - item.depth)
        first, second = item.context[a:b], item.context[c:d]
        answer = item.answer.strip()
        assert said(answer, first) != said(answer, second)  # in exactly one of them
        # The other names the subject the cue asks about, which the answer's lacks.
        asked = [w for w in re.findall(r"[a-z]+", item.cue) if w in data_recall._OBJECTS]
        assert asked and all(said(w, first + second) for w in asked)
        assert all(not said(w, first if said(answer, first) else second) for w in asked)
    # Of each phrasing's two sentences, either may come first.
    orders = {}
    for i in items:
        orders.setdefault(i.template, set()).add(said(i.answer.strip(), i.context[slice(*i.fact)]))
    assert orders == {t: {True, False} for t in range(len(TEMPLATES["combined"]))}


@pytest.mark.parametrize("depth", [0.05, 0.3, 0.6, 0.9])
@pytest.mark.parametrize("kind", PLAIN_KINDS)
def test_a_plain_fact_sits_at_the_depth_asked(kind, depth):
    for item in plain_items(6, depths=[depth], kinds=[kind], tokens=400):
        assert abs(item.depth - depth) < 0.06, (kind, depth, item.depth)
        start, end = item.fact
        if kind == "code":  # a comment or docstring on lines of its own
            assert item.context[start - 1] == "\n" and item.context[end] == "\n"
            assert item.context[start:end].strip().startswith(("#", "def "))
        else:  # a sentence of its own, between sentences
            assert item.context[start:end].endswith(".") and item.context[end] == " "


def test_yes_and_no_are_balanced_and_need_the_fact():
    items = plain_items(40, kinds=["yesno"])
    answers = [i.answer for i in items]
    assert set(answers) == {" yes", " no"} and answers.count(" yes") == 20
    for item in items:
        fact = item.context[slice(*item.fact)]
        asked = [w for w in re.findall(r"[a-z]+", item.cue.split("?")[0])
                 if w in data_recall._VOCABULARIES[PLAIN_TEMPLATE_VOCAB(item)]]
        # The word asked about is the fact's own exactly when the answer is yes.
        assert said(asked[-1], fact) == (item.answer == " yes")
        assert not said("yes", item.cue) and not said("no", item.cue)


def PLAIN_TEMPLATE_VOCAB(item):
    return data_recall.PLAIN_TEMPLATES[item.kind][item.template][2]


@pytest.mark.parametrize("kind", PLAIN_KINDS)
def test_plain_kinds_vary_their_phrasing_and_values(kind):
    assert len(TEMPLATES[kind]) >= 4
    items = plain_items(60, kinds=[kind])
    assert len({i.template for i in items}) == len(TEMPLATES[kind])
    if kind != "yesno":
        assert len({i.answer for i in items}) >= 30  # from a large vocabulary


def test_plain_vocabularies_are_large_lowercase_and_apart():
    vocabularies = [data_recall._OBJECTS, data_recall._PLACES, data_recall._ROLES,
                    data_recall._CONTAINERS]
    every = [w for v in vocabularies for w in v]
    assert len(every) == len(set(every))  # no word in two slots' vocabularies
    assert all(re.fullmatch(r"[a-z]+", w) for w in every)
    assert all(len(v) >= 60 for v in vocabularies[:3])


def test_kind_groups_are_spelled_out():
    assert expand_kinds("plain") == list(PLAIN_KINDS)
    assert expand_kinds("facts") == list(KINDS)
    assert expand_kinds(["number", "plain", "place"]) == ["number"] + list(PLAIN_KINDS)
    assert expand_kinds("all") == list(KINDS + PLAIN_KINDS) == list(KIND_GROUPS["all"])
    assert {i.kind for i in plain_items(12, kinds="plain")} == set(PLAIN_KINDS)
    with pytest.raises(KvlingoError, match="kinds"):
        expand_kinds("plain,colour")


def test_the_default_kinds_keep_their_items():
    """The plain kinds leave the fact-like kinds' items as they were."""
    items = recall_items(FILLER, 8, 300, words, seed=3)
    assert "more" not in items[0].to_dict()
    assert items == recall_items(FILLER, 8, 300, words, kinds="facts", seed=3)


def test_a_prints_item_holds_a_function_whose_output_is_the_answer():
    """The ``prints`` kind: a generated function put into code between two
    statements, indented as its neighbour; running the module's function gives the
    answer, and only its body (read once) says what it prints."""
    items = recall_items(FILLER, 9, 300, words, kinds="prints", seed=1, code_filler=CODE)
    assert {i.kind for i in items} == {"prints"}
    assert len({i.template for i in items}) == len(TEMPLATES["prints"])
    for item in items:
        start, end = item.fact
        body = item.context[start:end]
        name = re.search(r"def (\w+)\(\):", body).group(1)
        assert name in item.cue and item.context.count(f"def {name}(") == 1
        assert words(item.prompt) <= 300
        indent = re.match(r"[ \t]*", body).group()
        namespace = {}
        exec("\n".join(line[len(indent):] for line in body.split("\n")), namespace)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            namespace[name]()
        assert " " + out.getvalue().rstrip("\n") == item.answer
        after = item.context[end:].lstrip("\n")
        assert re.match(r"[ \t]*", after).group() == indent  # as the line it goes before
    depths = [i.depth for i in items]
    assert min(depths) < 0.3 and max(depths) > 0.3
    # In no group: asked for by name only.
    assert all("prints" not in kinds for kinds in KIND_GROUPS.values())


def test_bad_requests_are_refused():
    with pytest.raises(KvlingoError, match="kinds"):
        recall_items(FILLER, 4, 300, words, kinds=["colour"])
    with pytest.raises(KvlingoError, match="filler"):
        recall_items(FILLER[:1], 4, 300, words)


def test_an_answer_matches_only_as_a_whole_word():
    assert matches(" 58213.", " 58213")
    assert matches("58213 and more", " 58213")
    assert not matches(" 582.", " 58213")
    assert not matches(" 582131", " 58213")
    assert matches(" Pomi Gufa, who", " Pomi Gufa")
    assert not matches(" pomi gufa", " Pomi Gufa")  # a name's case counts


def test_a_plain_answer_matches_in_any_case_and_as_a_whole_word():
    assert matches(" Yes, he did.", " yes", plain=True)
    assert matches('\n"No."', " no", plain=True)
    assert matches(" **Cellar**", " cellar", plain=True)
    assert not matches(" Yes", " yes")  # only plain answers fold case
    assert not matches(" nothing", " no", plain=True)
    assert not matches(" yesterday", " yes", plain=True)
    assert not matches(" the cellar", " cellar", plain=True)
    assert matches(" cellar door", " cellar", plain=True)


def test_the_oracle_covers_both_facts_of_a_combined_item():
    item = plain_items(1, kinds=["combined"])[0]
    offsets, pos = [], 0
    for w in item.context.split(" "):
        offsets.append((pos, pos + len(w)))
        pos += len(w) + 1
    chosen = fact_positions(item, offsets)
    for a, b in item.facts:
        assert any(offsets[i][0] < b and offsets[i][1] > a for i in chosen)
        assert any(offsets[i][0] >= a for i in chosen)


def test_truncation_keeps_the_bos_and_the_last_tokens():
    assert truncated_ids([1, 5, 6, 7, 8], 2, bos=1) == [1, 7, 8]
    assert truncated_ids([5, 6, 7, 8], 2, bos=1) == [7, 8]
    assert truncated_ids([1, 5, 6], 9, bos=1) == [1, 5, 6]


def test_equal_time_interpolates_between_measured_lengths():
    times = {16: 0.1, 64: 0.2, 256: 0.6, 550: 1.2}
    assert equal_time_tokens(times, 0.4) == 160
    assert equal_time_tokens(times, 5.0) == 550  # clamped
    assert equal_time_tokens(times, 0.0) == 16


class WordTokenizer:
    """Words as tokens (ids stable per word), with character offsets."""

    bos_token_id = None

    def __init__(self):
        self.vocab = {}

    def _ids(self, text):
        out, offsets, pos = [], [], 0
        for w in text.split(" "):
            if w:
                out.append(self.vocab.setdefault(w, 2 + len(self.vocab) % 90))
                offsets.append((pos, pos + len(w)))
            pos += len(w) + 1
        return out, offsets

    def encode(self, text, add_special_tokens=True):
        return self._ids(text)[0]

    def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
        ids, offsets = self._ids(text)
        return {"input_ids": ids, "offset_mapping": offsets}

    def decode(self, ids, **kw):
        inverse = {v: k for k, v in self.vocab.items()}
        return "".join(" " + inverse.get(i, "?") for i in ids)

    def get_vocab(self):
        return dict(self.vocab)


def test_an_exact_switch_scores_as_the_native_prefill():
    """With an identity translator a switch is a re-prefill: same greedy answers,
    same answer NLLs; the equal-time baseline is a truncation between the
    measured lengths; every setting scored every item."""
    m = tiny_model("qwen3")
    tok = WordTokenizer()
    items = recall_items(FILLER, 3, 120, words, seed=1)
    t = identity_translator(m, tok)
    result = measure_recall(m, tok, m, tok, t, items, truncations=(8, 32), recompute=[0.1],
                            oracle=True, log=lambda s: None)
    recompute = recompute_setting(0.1)
    assert set(result.scores) == {NATIVE, SWITCH, recompute, ORACLE, "last 8", "last 32",
                                  NONE, EQUAL_TIME, f"{EQUAL_TIME} ({recompute})"}
    assert all(len(v) == 3 for v in result.scores.values())
    for a, b, c, d in zip(*(result.scores[k] for k in (NATIVE, SWITCH, recompute, ORACLE))):
        assert a.said == b.said == c.said == d.said  # recomputing exact positions: no change
        assert abs(a.answer_nll - d.answer_nll) < 1e-3
        assert abs(a.answer_nll - b.answer_nll) < 1e-3
        assert a.read == b.read
    assert 8 <= result.equal_time_tokens <= max(s.read for s in result.scores[NATIVE])
    assert result.exact_rate(NATIVE).value == result.exact_rate(SWITCH).value
    assert "| switch |" in format_table(result)


def test_a_default_setting_switches_with_the_translators_own_budget(monkeypatch):
    """recompute=[None]: the translator file's default budget (share, cap and
    reserve), under its own name."""
    import mlx_kvlingo.measure.recall as recall

    m = tiny_model("qwen3")
    tok = WordTokenizer()
    items = recall_items(FILLER, 1, 120, words, seed=1)
    t = identity_translator(m, tok)
    asked, switch_state = [], recall.switch_state
    monkeypatch.setattr(recall, "switch_state", lambda *a: asked.append(a[-3:-1]) or switch_state(*a))
    result = measure_recall(m, tok, m, tok, t, items, truncations=(8,), recompute=[None, 0.2],
                            recompute_max=7, log=lambda s: None)
    assert recall.DEFAULT_RECOMPUTE in result.scores and recompute_setting(0.2, 7) in result.scores
    assert asked == [(0.0, 7), (None, None), (0.2, 7)]


def test_a_rerun_resumes_from_the_checkpoint(tmp_path):
    """Scored items are appended to the checkpoint; a rerun restores them instead of
    scoring them again, and scores only the items the file lacks."""
    m = tiny_model("llama")
    tok = WordTokenizer()
    items = recall_items(FILLER, 3, 100, words, seed=2)
    t = identity_translator(m, tok)
    path = tmp_path / "items.jsonl"
    first = measure_recall(m, tok, m, tok, t, items[:2], truncations=(8,), log=lambda s: None,
                           checkpoint=path)
    assert len(path.read_text().splitlines()) == 2
    with open(path, "a") as f:
        f.write('{"key": "cut off by an interrup')  # a half-written last line
    logs = []
    again = measure_recall(m, tok, m, tok, t, items, truncations=(8,), log=logs.append,
                           checkpoint=path)
    assert logs[0].strip().startswith("2 of 3 items")
    scored = [line for line in logs if "item " in line and "/3" in line]
    assert len(scored) == 1 and scored[0].strip().startswith("item 3/3")
    for setting in [k for k in first.scores if not k.startswith(EQUAL_TIME)]:
        for a, b in zip(first.scores[setting], again.scores[setting]):
            assert a == b  # restored, not rescored (times would differ)
    # Other settings (a recompute budget the file lacks): every item is scored again.
    logs.clear()
    measure_recall(m, tok, m, tok, t, items, truncations=(8,), recompute=[0.2],
                   log=logs.append, checkpoint=path)
    assert sum("item " in line for line in logs) == 3


def test_plain_items_are_scored_per_kind_with_their_matching(monkeypatch):
    """Plain answers are matched in any case, the others as they are; exact match and
    answer NLL come per kind."""
    import mlx_kvlingo.measure.recall as recall

    m = tiny_model("qwen3")
    tok = WordTokenizer()
    items = (recall_items(FILLER, 2, 120, words, seed=1)
             + plain_items(3, kinds=["yesno", "combined", "code"], tokens=120))
    asked, matches_ = [], recall.matches
    monkeypatch.setattr(recall, "matches",
                        lambda said, answer, plain=False: asked.append((answer, plain))
                        or matches_(said, answer, plain))
    result = measure_recall(m, tok, m, tok, identity_translator(m, tok), items,
                            truncations=(8,), oracle=True, log=lambda s: None)
    per_item = len(asked) // len(items) - 1  # the equal-time truncation's come last
    for k, item in enumerate(items):
        flags = {plain for answer, plain in asked[k * per_item:(k + 1) * per_item]}
        assert flags == {item.kind in PLAIN_KINDS}
    nll = result.nll_by_kind(NATIVE)
    assert set(nll) == {"number", "name", "yesno", "combined", "code"}
    assert nll["code"] == result.scores[NATIVE][-1].answer_nll
    table = format_kinds(result)
    assert table.splitlines()[0] == ("| exact match / answer NLL | number (1) | name (1) | "
                                     "yesno (1) | combined (1) | code (1) |")
    assert len(table.splitlines()) == 2 + len(result.scores)
    assert result.to_dict()["summary"][NATIVE]["nll_by_kind"] == nll


def test_eval_task_recall_takes_kind_groups(monkeypatch):
    """`mlx-kvlingo eval --task recall --kinds plain` scores the plain kinds; an
    unknown kind is one line of error, before any model is loaded."""
    from typer.testing import CliRunner

    import mlx_kvlingo.measure.recall as recall
    import mlx_kvlingo.pairs.shipped as shipped
    from mlx_kvlingo_cli import main

    asked = []

    def fake_run(source, target, translator, tokens, items, kinds, **kw):
        asked.append(list(kinds))
        its = plain_items(2, kinds=kinds, tokens=120)
        score = recall.RecallScore(True, 0.5, 0.1, " yes", 100)
        return recall.RecallResult(source, target, its, {NATIVE: [score] * len(its)})

    monkeypatch.setattr(recall, "run_recall",
                        lambda s, t, tr, tokens, items, **kw: fake_run(s, t, tr, tokens, items,
                                                                       **kw))
    monkeypatch.setattr(shipped, "translator_for", lambda *a: None)
    monkeypatch.setattr(main, "_warn_if_slow_blas", lambda: None)
    runner = CliRunner()
    args = ["eval", "--task", "recall", "--source", "a", "--target", "b"]
    out = runner.invoke(main.app, args + ["--kinds", "plain"])
    assert out.exit_code == 0, out.output
    assert asked == [list(PLAIN_KINDS)] and "place (1)" in out.output
    out = runner.invoke(main.app, args)
    assert asked[-1] == list(KINDS)
    out = runner.invoke(main.app, args + ["--kinds", "plain,colour"])
    assert out.exit_code == 1 and "colour" in out.output and len(asked) == 2


def test_a_yes_no_answer_nll_is_its_likeliest_spelling():
    """After "Answer:" models write " Yes" as readily as " yes": the answer NLL is the
    likelier of the two; other kinds have one spelling."""
    from mlx_kvlingo.measure.recall import answer_tokens, answer_variants, native_state, score_state

    m = tiny_model("qwen3")
    tok = WordTokenizer()
    for item in plain_items(2, kinds=["yesno"], tokens=120):
        ids = tok.encode(item.prompt)
        lower = answer_tokens(tok, ids, item.prompt, item.answer)
        (upper,) = answer_variants(tok, ids, item)
        assert tok.decode(upper) == " " + item.answer.strip().title() != tok.decode(lower)
        each = [score_state(m, tok, native_state(m, ids), a, item.answer, True).answer_nll
                for a in (lower, upper)]
        both = score_state(m, tok, native_state(m, ids), lower, item.answer, True, [upper])
        assert both.answer_nll == pytest.approx(min(each), abs=1e-5) and each[0] != each[1]
    place = plain_items(1, kinds=["place"], tokens=120)[0]
    assert answer_variants(tok, tok.encode(place.prompt), place) == []


def test_a_conversation_gives_both_facts_of_a_combined_item_to_its_first_reader():
    from mlx_kvlingo.measure.session_recall import pieces

    for item in plain_items(6, kinds=["combined"], depths=[0.3]):
        first = pieces(item)[0]
        assert all(b <= len(first) for _, b in item.facts)
