"""The TTFT benchmark's measuring code and command, on the built-in pair (tiny runs:
speed targets belong to the benchmark itself, not to tests)."""

import json

import mlx.core as mx
import typer
from typer.testing import CliRunner

from mlx_kvlingo.measure.ttft import format_rows, format_split, measure_ttft, plot_ttft
from mlx_kvlingo.models.rope import apply_rope_tables, rope_tables
from mlx_kvlingo.translator.maps import Translator

KEYS = {"context", "prefill_s", "switch_s", "ratio", "translate_s", "decode_s",
        "translate_peak_mb", "translate_extra_mb", "decode_step_s", "maps_s", "ceiling_s",
        "ceiling_ratio", "fraction", "native_tail", "memory", "translate_profile"}
PARTS = {"align_s", "native_prefix_s", "read_unrope_s", "maps_s", "rerope_write_s",
         "first_step_s"}


def test_measure_ttft_times_switch_prefill_and_ceiling(toy_pair, tmp_path):
    src, stok, tgt, ttok = toy_pair
    translator = Translator.for_models(src, tgt, stok, ttok)
    stream = stok.encode("Return a new list containing all items from the iterable in "
                         "ascending order. " * 8)
    rows = measure_ttft(src, tgt, translator, stream, contexts=(16, 48), repeats=2, warmup=1,
                        native_tails=(0, 4), rounds=3)
    assert [(r.context, r.native_tail) for r in rows] == [(16, 0), (16, 4), (48, 0), (48, 4)]
    for r in rows:
        d = r.to_dict()
        assert KEYS <= set(d)
        assert r.prefill_s > 0 and r.translate_s > 0 and r.decode_s > 0
        assert abs(r.ratio - r.prefill_s / r.switch_s) < 1e-9
        assert abs(r.ceiling_s - (r.decode_step_s + r.maps_s)) < 0.5 * r.ceiling_s
        assert abs(r.fraction - r.ratio / r.ceiling_ratio) < 1e-9
        assert len(r.prefill_all_s) == 2  # one re-prefill per run
        assert len(r.switch_all_s) == len(r.ceiling_all_s) == 2 * 3  # rounds per run
        mem = r.memory
        assert mem["target_cache_mb"] > 0 and mem["source_cache_mb"] > 0 and mem["maps_mb"] > 0
        assert abs(mem["bound_mb"] - (mem["source_cache_mb"] + mem["target_cache_mb"]
                                      + mem["maps_mb"] + mem["layer_working_set_mb"])) < 1e-6
        assert mem["within_bound"] == float(mem["switch_peak_mb"] <= mem["bound_mb"])
        assert mem["first_step_activations_mb"] > 0
        assert r.translate_peak_mb > 0  # MLX's allocator reports peaks on the CPU too
        if r.native_tail == 0:
            assert set(r.translate_profile) == PARTS
    assert len(format_rows(rows).splitlines()) == 5
    assert len(format_split(rows).splitlines()) == 3  # header + one profile per context
    plot_ttft(rows, tmp_path / "ttft.png")
    assert (tmp_path / "ttft.png").stat().st_size > 1000


def test_the_bare_step_is_timed_again_on_an_untouched_copy_of_the_prefill(toy_pair):
    """The ceiling's bare step, re-timed each round, runs on a fresh copy of the
    prefilled cache: the copy it is made from keeps its length and contents."""
    import mlx.core as mx

    from mlx_kvlingo.measure.ttft import timed_bare_step, timed_prefill

    _, stok, tgt, _ = toy_pair
    tokens = mx.array(stok.encode("Return a new list of the items. " * 6))
    p, d, saved = timed_prefill(tgt, tokens)
    assert p > d > 0
    before = [(c.offset, mx.array(c.keys)) for c in saved]
    for _ in range(2):
        assert timed_bare_step(tgt, saved, tokens[-1:]) > 0
    for (offset, keys), c in zip(before, saved):
        assert c.offset == offset == tokens.size - 1
        assert mx.array_equal(c.keys, keys)


def test_measure_ttft_aligns_text_for_different_tokenizers():
    """A cross-tokenizer pair is timed on text, the alignment inside the switch; the
    context is counted in target tokens."""
    from test_align import TEXT, _bpe
    from tiny import tiny_model

    stok, ttok = _bpe(300), _bpe(330, bos=True)
    src, tgt = tiny_model("llama", vocab_size=300), tiny_model("qwen3", seed=1, vocab_size=330)
    translator = Translator.for_models(src, tgt, stok, ttok)
    assert translator.cross_tokenizer
    rows = measure_ttft(src, tgt, translator, None, contexts=(40,), repeats=1, warmup=0,
                        text=TEXT * 3, tokenizers=(stok, ttok))
    (r,) = rows
    assert r.context == 40 and r.switch_s > 0 and r.translate_profile["align_s"] > 0


def test_bench_ttft_command_writes_json_and_plot(toy_pair_dirs, tmp_path):
    from mlx_kvlingo_cli.session_cmds import register

    app = typer.Typer(add_completion=False)
    register(app)
    out = tmp_path / "ttft.json"
    r = CliRunner().invoke(app, ["bench", "ttft", "--quick", "--json", str(out), "--target",
                                 str(toy_pair_dirs[1]), "--contexts", "32,64,1024",
                                 "--native-tail", "0,8"])
    assert r.exit_code == 0, r.output
    result = json.loads(out.read_text())
    assert [(row["context"], row["native_tail"]) for row in result["rows"]] == [
        (32, 0), (32, 8), (64, 0), (64, 8)]  # --quick: up to 256
    assert all(KEYS <= set(row) for row in result["rows"])
    assert result["repeats"] == 2 and "random maps" in result["translator"]
    env = result["environment"]
    assert env["mlx"] == mx.__version__ and env["cpu_count"] and env["platform"]
    assert (tmp_path / "ttft.png").exists()
    assert "ceiling" in r.output and "fraction" in r.output and "Wrote" in r.output
    bad = CliRunner().invoke(app, ["bench", "ttft", "--json", str(out), "--contexts", "x"])
    assert bad.exit_code == 1 and "--contexts" in bad.output
    bad = CliRunner().invoke(app, ["bench", "ttft", "--json", str(out), "--native-tail", "-1"])
    assert bad.exit_code == 1 and "--native-tail" in bad.output


def test_rope_tables_reproduce_the_rope_modules_exactly():
    """The rope tables (cos/sin probed from the module) rotate and un-rotate exactly
    like the module, for plain, traditional, partial and scaled ropes."""
    import mlx.nn as nn
    from mlx_lm.models.rope_utils import Llama3RoPE

    from mlx_kvlingo.models.rope import unrope

    x = mx.random.normal((1, 2, 9, 16), key=mx.random.key(0))
    ropes = [nn.RoPE(16), nn.RoPE(16, traditional=True), nn.RoPE(8, base=500.0),
             Llama3RoPE(16, max_position_embeddings=64, base=500000.0,
                        scaling_config={"factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 16})]
    for rope in ropes:
        t = rope_tables(rope, 5, 9, 16)
        assert mx.abs(apply_rope_tables(x, t, rope) - rope(x, offset=5)).max().item() < 1e-5
        back = apply_rope_tables(x, t, rope, inverse=True)
        assert mx.abs(back - unrope(rope, x, 5)).max().item() < 1e-5


def test_measure_ttft_counts_token_maps(toy_pair):
    """A translator with token maps: the maps' time and bytes include them."""
    src, stok, tgt, ttok = toy_pair
    plain = Translator.for_models(src, tgt, stok, ttok)
    with_tokens = Translator.for_models(src, tgt, stok, ttok, token_layers=[0, 1])
    stream = stok.encode("Return a new list containing all items in ascending order. " * 4)
    mb, working = {}, {}
    for name, t in (("plain", plain), ("tokens", with_tokens)):
        (row,) = measure_ttft(src, tgt, t, stream, contexts=(16,), repeats=1, warmup=0,
                              native_tails=(0,), rounds=1)
        mb[name] = row.memory["maps_mb"]
        working[name] = row.memory["layer_working_set_mb"]
        assert row.maps_s > 0
    token_bytes = sum(m.weight.nbytes for m in with_tokens.k_tok + with_tokens.v_tok)
    assert abs((mb["tokens"] - mb["plain"]) * 2**20 - token_bytes) < 1
    # The token inputs the switch holds: at least the 16-token context's rows.
    extra = (working["tokens"] - working["plain"]) * 2**20
    assert extra >= 15 * with_tokens.spec.token_width * 4
