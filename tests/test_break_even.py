"""The break-even: below it a catch-up computes its span natively instead of
translating it (switching.break_even, switching.catch_up, Session, the CLI)."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from test_cli import run_cli
from tiny import identity_translator

from mlx_kvlingo.chat.session import Session
from mlx_kvlingo.errors import KvlingoError
from mlx_kvlingo.models.cache import prefill
from mlx_kvlingo.switching.break_even import (
    BreakEven,
    break_even_for,
    measure_break_even,
    store_break_even,
    stored_break_even,
)
from mlx_kvlingo.switching.catch_up import Run, catch_up
from mlx_kvlingo.translator.maps import Translator

TEXT = "The parser reads each line, strips it and keeps the fields it names. " * 12


@pytest.fixture(scope="module")
def pair(toy_pair):
    src, stok, tgt, ttok = toy_pair
    return src, stok, tgt, ttok, Translator.for_models(src, tgt, stok, ttok)


def test_a_catch_up_under_the_break_even_is_computed_natively(pair):
    src, stok, tgt, ttok, t = pair
    ids = ttok.encode(TEXT)[:40]
    source_cache = prefill(src, mx.array(ids)[None])
    question = ttok.encode(" And then?")

    def run(break_even):
        runs = [Run(0, 1), Run(1, len(ids), "src", src, source_cache, t)]
        return catch_up(tgt, make_prompt_cache(tgt), ids, 0, runs, question,
                        break_even=break_even)

    native = run(len(ids))  # 39 positions to translate, fewer than 40
    assert native.translated == {} and native.prefilled == len(ids)
    assert native.fallback and "break-even" in native.fallback
    want = prefill(tgt, mx.array(ids)[None])
    assert mx.abs(native.cache[0].keys[..., :len(ids), :]
                  - want[0].keys[..., :len(ids), :]).max().item() < 1e-5
    translated = run(len(ids) - 1)  # 39 is not fewer than 39: translated
    assert translated.translated == {"src": len(ids) - 1} and translated.fallback is None


def test_a_session_prefills_catch_ups_under_its_break_even(target_pair_twin):
    m, tok = target_pair_twin

    def second_turn(**kw):
        s = Session({"a": (m, tok), "b": (m, tok)},
                    {("a", "b"): identity_translator(m, tok)}, **kw)
        s.generate("a", "Return the sum of the items.", max_tokens=3)
        s.generate("b", "Close the file.", max_tokens=2)
        return s.reports[-1]

    assert second_turn(break_even=0).translated > 0
    r = second_turn(break_even=10_000)
    assert r.translated == 0 and "break-even" in r.fallback
    with pytest.raises(KvlingoError, match="break_even"):
        Session(break_even=-1)


@pytest.fixture(scope="module")
def target_pair_twin(toy_pair):
    return toy_pair[2], toy_pair[3]


def test_measuring_finds_a_length_and_keeps_it_per_pair(pair, tmp_path):
    src, stok, tgt, ttok, t = pair
    calls = []
    found = measure_break_even(src, tgt, t, stok.encode(TEXT), ttok.encode(TEXT),
                               lengths=(16, 32, 64), repeats=1,
                               progress=lambda *a: calls.append(a))
    assert [c[0] for c in calls] == list(found.seconds)[:len(calls)]
    assert all(c[1] > 0 and c[2] > 0 for c in calls)
    assert found.tokens in (16, 32, 64, 128) and found.machine
    assert stored_break_even(t, tgt, tmp_path) is None
    store_break_even(found, t, tgt, tmp_path)
    assert stored_break_even(t, tgt, tmp_path) == found.tokens
    store_break_even(BreakEven(7, {}, found.machine), t, tgt, tmp_path)  # a new measurement
    assert stored_break_even(t, tgt, tmp_path) == 7
    with pytest.raises(KvlingoError, match="at least"):
        measure_break_even(src, tgt, t, stok.encode("short"), ttok.encode("short"))


@pytest.mark.parametrize("wins,want", [([False, True, True], 32), ([True, True], 16),
                                       ([True, False, True, True], 64),
                                       ([False, False], 64)])
def test_the_break_even_is_where_the_switch_starts_winning_for_good(wins, want):
    from mlx_kvlingo.switching.break_even import first_lasting_win

    assert first_lasting_win([16, 32, 64, 128][:len(wins)], wins) == want


def test_the_cli_measures_and_keeps_the_break_even(toy_pair_dirs, pair, tmp_path):
    src, stok, tgt, ttok, t = pair
    path = tmp_path / "t.safetensors"
    t.save(path)
    proc = run_cli("break-even", "--source", toy_pair_dirs[0], "--target", toy_pair_dirs[1],
                   "--translator", path, "--repeats", "1", env={"MLX_KVLINGO_CACHE": tmp_path})
    assert "break-even:" in proc.stdout and "prefill ms" in proc.stdout
    assert stored_break_even(t, tgt, tmp_path) is not None


def test_a_files_break_even_serves_until_this_machine_measures_its_own(pair, tmp_path):
    src, stok, tgt, ttok, t = pair
    assert break_even_for(t, tgt, tmp_path) == (0, "the file's")  # files without one
    t.spec.break_even = 256
    path = tmp_path / "t.safetensors"
    t.save(path)
    from mlx_kvlingo.translator.maps import load_translator

    loaded = load_translator(path)
    assert break_even_for(loaded, tgt, tmp_path) == (256, "the file's")
    store_break_even(BreakEven(48, {}, "here"), loaded, tgt, tmp_path)
    assert break_even_for(loaded, tgt, tmp_path) == (48, "measured here")
    t.spec.break_even = 0


def test_a_session_prefills_under_its_files_break_even(target_pair_twin, tmp_path,
                                                       monkeypatch):
    """With nothing measured on this machine, a catch-up shorter than the file's
    break-even prefills; a session's own break-even still overrides it."""
    from mlx_kvlingo.pairs.assemble import describe_session

    monkeypatch.setenv("MLX_KVLINGO_CACHE", str(tmp_path))  # nothing measured here
    m, tok = target_pair_twin
    t = identity_translator(m, tok)
    t.spec.break_even = 10_000

    def second_turn(**kw):
        s = Session({"a": (m, tok), "b": (m, tok)}, {("a", "b"): t}, **kw)
        s.generate("a", "Return the sum of the items.", max_tokens=3)
        s.generate("b", "Close the file.", max_tokens=2)
        return s, s.reports[-1]

    s, r = second_turn()
    assert r.translated == 0 and "break-even" in r.fallback
    assert "a -> b 10000 (the file's)" in describe_session(s)
    assert second_turn(break_even=0)[1].translated > 0


def test_a_session_says_which_break_even_it_uses(target_pair_twin):
    from mlx_kvlingo.pairs.assemble import describe_session

    m, tok = target_pair_twin
    s = Session({"a": (m, tok), "b": (m, tok)}, {("a", "b"): identity_translator(m, tok)})
    assert "break-even: a -> b not measured" in describe_session(s)
    s.break_even = 64
    assert "catch-ups under 64 positions prefill" in describe_session(s)
