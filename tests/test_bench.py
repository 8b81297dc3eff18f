"""The TTFT benchmark's measuring code and command, on the built-in pair (tiny runs:
speed targets belong to the benchmark itself, not to tests)."""

import json

import mlx.core as mx
import typer
from typer.testing import CliRunner

from mlx_kvlingo.bench import (
    apply_rope_tables,
    format_rows,
    measure_ttft,
    plot_ttft,
    profile_translate,
    rope_tables,
)
from mlx_kvlingo.models import prefill
from mlx_kvlingo.translator import Translator

KEYS = {"context", "prefill_s", "switch_s", "ratio", "translate_s", "decode_s",
        "translate_peak_mb", "translate_extra_mb"}


def test_measure_ttft_times_both_paths(toy_pair, tmp_path):
    src, stok, tgt, ttok = toy_pair
    translator = Translator.for_models(src, tgt, stok, ttok)
    stream = stok.encode("Return a new list containing all items from the iterable in "
                         "ascending order. " * 8)
    rows = measure_ttft(src, tgt, translator, stream, contexts=(16, 48), repeats=2, warmup=1)
    assert [r.context for r in rows] == [16, 48]
    for r in rows:
        d = r.to_dict()
        assert KEYS <= set(d)
        assert r.prefill_s > 0 and r.translate_s > 0 and r.decode_s > 0
        assert abs(r.ratio - r.prefill_s / r.switch_s) < 1e-9
        assert len(r.switch_all_s) == len(r.prefill_all_s) == 2
        assert r.translate_peak_mb > 0  # MLX's allocator reports peaks on the CPU too
        assert set(r.translate_profile) == {"native_prefix_s", "read_unrope_s", "maps_s",
                                            "rerope_write_s"}
        # The prototype of the faster translation builds the shipped path's cache.
        assert r.translate_proposed_s > 0 and r.proposed_max_abs_diff < 1e-4
        assert r.decode_step_s > 0
    assert len(format_rows(rows).splitlines()) == 3
    plot_ttft(rows, tmp_path / "ttft.png")
    assert (tmp_path / "ttft.png").stat().st_size > 1000


def test_profiled_translation_builds_the_same_cache_as_switch(toy_pair):
    from mlx_kvlingo.switch import translate_cache

    src, stok, tgt, ttok = toy_pair
    translator = Translator.for_models(src, tgt, stok, ttok)
    tokens = mx.array(stok.encode("Open the file and return a stream of its lines."))
    source_cache = prefill(src, tokens[None, :-1])
    prof = profile_translate(src, tgt, translator, source_cache, tokens)
    assert all(v >= 0 for v in prof.values())
    cache = translate_cache(src, tgt, translator, source_cache, tokens)
    assert cache[0].offset == tokens.size - 1


def test_bench_ttft_command_writes_json_and_plot(toy_pair_dirs, tmp_path):
    from mlx_kvlingo_cli.session_cmds import register

    app = typer.Typer(add_completion=False)
    register(app)
    out = tmp_path / "ttft.json"
    r = CliRunner().invoke(app, ["bench", "ttft", "--quick", "--json", str(out), "--target",
                                 str(toy_pair_dirs[1]), "--contexts", "32,64,1024"])
    assert r.exit_code == 0, r.output
    result = json.loads(out.read_text())
    assert [row["context"] for row in result["rows"]] == [32, 64]  # --quick: up to 256
    assert all(KEYS <= set(row) for row in result["rows"])
    assert result["repeats"] == 2 and "random maps" in result["translator"]
    env = result["environment"]
    assert env["mlx"] == mx.__version__ and env["cpu_count"] and env["platform"]
    assert (tmp_path / "ttft.png").exists()
    assert "ratio" in r.output and "Wrote" in r.output
    bad = CliRunner().invoke(app, ["bench", "ttft", "--json", str(out), "--contexts", "x"])
    assert bad.exit_code == 1 and "--contexts" in bad.output


def test_rope_tables_reproduce_the_rope_modules_exactly():
    """The proposed rope path (cos/sin probed from the module) rotates and un-rotates
    exactly like the module, for plain, traditional, partial and scaled ropes."""
    import mlx.nn as nn
    from mlx_lm.models.rope_utils import Llama3RoPE

    from mlx_kvlingo.models import unrope

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
