"""The CLI follows mlx-lm's conventions: `-m` is `--max-tokens`, `--prompt -` reads
standard input, `--temp` / `--top-p` / `--seed` sample, `switch` prints its answer as
it is generated, and no help text shows a doubled percent sign."""

import io
import sys
from pathlib import Path

import click
import pytest
import typer
from typer.testing import CliRunner

from mlx_kvlingo_cli.common import echo_stream, make_sampler, read_prompt
from mlx_kvlingo_cli.main import switch_printer, app

TOY = Path(__file__).resolve().parents[1] / "mlx_kvlingo" / "assets" / "toy_pair"
TOY_TRANSLATOR = TOY / "source-to-target.safetensors"


def commands():
    """{name: click command} for every command and subcommand of the app."""
    found = {}

    def walk(cmd, prefix):
        for name, sub in getattr(cmd, "commands", {}).items():
            if isinstance(sub, click.Group):
                walk(sub, f"{prefix}{name} ")
            else:
                found[f"{prefix}{name}"] = sub

    walk(typer.main.get_command(app), "")
    return found


@pytest.mark.parametrize("name", sorted(commands()))
def test_dash_m_is_max_tokens_wherever_it_is_used(name):
    for param in commands()[name].params:
        if "-m" in getattr(param, "opts", []):
            assert param.name == "max_tokens" and "--max-tokens" in param.opts, (name, param)


def test_commands_that_generate_take_dash_m():
    for name in ("switch", "chat", "demo"):
        opts = [p for p in commands()[name].params if p.name == "max_tokens"][0].opts
        assert "-m" in opts and "--max-tokens" in opts, name
    for name in ("switch", "chat"):
        names = {p.name for p in commands()[name].params}
        assert {"temp", "top_p", "seed"} <= names, name
    assert "--prompt-cache-file" in [o for p in commands()["convert-cache"].params
                                     for o in getattr(p, "opts", [])]


@pytest.mark.parametrize("name", sorted(commands()))
def test_help_shows_no_doubled_percent(name):
    result = CliRunner().invoke(app, [*name.split(), "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "%%" not in result.output


def test_read_prompt_dash_reads_stdin(tmp_path):
    assert read_prompt("-", stdin=io.StringIO("from stdin")) == "from stdin"
    assert read_prompt("plain") == "plain"
    f = tmp_path / "p.txt"
    f.write_text("from a file")
    assert read_prompt(None, f) == "from a file"
    assert read_prompt(None) is None


def test_make_sampler_greedy_at_temp_0_and_seeded():
    import mlx.core as mx

    assert make_sampler(0.0) is None
    logprobs = mx.log(mx.array([[0.25, 0.25, 0.25, 0.25]]))
    draws = [make_sampler(1.0, 1.0, seed=3)(logprobs).item() for _ in range(2)]
    assert draws[0] == draws[1]  # the same seed, the same draw


def test_switch_reads_stdin_honours_dash_m_and_streams(monkeypatch):
    """`switch --prompt - -m 5 --temp 0.7`: the prompt comes from standard input,
    max_tokens and a sampler reach the switch, and the first segment is on standard
    output before the second is generated."""
    from mlx_kvlingo.switching import pipeline as compare

    seen = {}

    def fake_run_switch(src, src_tok, tgt, tgt_tok, t, context, max_tokens, compare_, **kw):
        seen.update(context=src_tok.decode(context), max_tokens=max_tokens,
                    sampler=kw["sampler"])
        kw["on_text"]("switch", "first segment")
        sys.stdout.flush()
        seen["before_second"] = sys.stdout.buffer.getvalue().decode()
        kw["on_text"]("switch", " second")
        return {"context_tokens": len(context), "translate_s": 0.001,
                "switch_ttft_s": 0.002, "switch_answer": "first segment second",
                "switch_tokens": [1, 2]}

    monkeypatch.setattr(compare, "run_switch", fake_run_switch)
    result = CliRunner().invoke(
        app, ["switch", "--source", str(TOY / "source"), "--target", str(TOY / "target"),
              "--translator", str(TOY_TRANSLATOR), "--prompt", "-", "-m", "5",
              "--temp", "0.7", "--seed", "1", "--ignore-chat-template"],
        input="Return the sum of the list.")
    assert result.exit_code == 0, result.output
    assert "Return the sum of the list." in seen["context"]
    assert seen["max_tokens"] == 5 and seen["sampler"] is not None
    assert "first segment" in seen["before_second"]
    assert "second" not in seen["before_second"]
    assert "--- target after switch ---\nfirst segment second\n" in result.output


def test_run_switch_hands_each_segment_over_while_generating(monkeypatch):
    """On the built-in pair: every segment of the switched answer reaches the
    printer before the next token is generated, and together they are the answer."""
    import mlx_kvlingo as kv
    from mlx_kvlingo.switching import pipeline as compare

    events = []
    original = compare.generate_after_switch

    def watched(*args, **kwargs):
        for r in original(*args, **kwargs):
            events.append("generated")
            yield r

    monkeypatch.setattr(compare, "generate_after_switch", watched)
    src, src_tok = kv.load(str(TOY / "source"))
    tgt, tgt_tok = kv.load(str(TOY / "target"))
    t = kv.load_translator(TOY_TRANSLATOR)
    printed = []

    def write(segment):
        events.append("printed")
        printed.append(segment)

    tokens = src_tok.encode("Return the number of items in the list, and close the file.")
    r = compare.run_switch(src, src_tok, tgt, tgt_tok, t, tokens, 12, False,
                           on_text=switch_printer(write))
    assert "".join(printed) == "--- target after switch ---\n" + r["switch_answer"]
    # A segment is printed between two generated tokens, not only at the end.
    first_print = events.index("printed")
    assert first_print < len(events) - 1 - events[::-1].index("generated")


def test_echo_stream_flushes_each_segment():
    class Out(io.StringIO):
        flushes = 0

        def flush(self):
            Out.flushes += 1

    out = Out()
    write = echo_stream(out)
    write("a")
    write("b")
    assert out.getvalue() == "ab" and Out.flushes == 2


def test_plots_without_matplotlib_name_the_extra(monkeypatch, tmp_path):
    """matplotlib is the optional `plot` extra: a plot asked for without it is a
    one-line error naming the extra; the training curve is skipped."""
    from mlx_kvlingo import plotting
    from mlx_kvlingo.errors import KvlingoError
    from mlx_kvlingo.measure.ttft import plot_ttft
    from mlx_kvlingo.train.loop import write_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    assert not plotting.available()
    with pytest.raises(KvlingoError, match=r"mlx-kvlingo\[plot\]"):
        plot_ttft([], tmp_path / "x.png")
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1, "loss": 0.5}\n')
    assert write_plot(log, tmp_path / "curve.png") is False
    assert not (tmp_path / "curve.png").exists()


def test_matplotlib_is_an_extra_not_a_dependency():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    project = config["project"]
    assert not any(d.startswith("matplotlib") for d in project["dependencies"])
    assert project["optional-dependencies"]["plot"] == ["matplotlib"]


def test_train_progress_draws_a_bar_with_eta_on_stderr(capsys):
    """Stage 2 on a terminal: step / total with an ETA on stderr, evaluations and
    skipped steps printed as lines; without a terminal, the plain lines only."""
    from mlx_kvlingo_cli.main import TrainProgress

    progress = TrainProgress(True)
    for step in (1, 2, 3):
        progress({"step": step, "loss": 0.5, "applied": step != 2, "lr": 1e-4,
                  "tokens_per_s": 100.0, "total": 5})
    progress({"step": 3, "eval": {"kl": 0.1, "kl_none": 0.5, "top1": 0.5, "cbr": 0.8,
                                  "cbr_meaningful": True}})
    progress.close()
    out, err = capsys.readouterr()
    assert "stage 2" in err and "3/5" in err and "<" in err  # elapsed<remaining
    assert "SKIPPED" in out and "eval @ step 3" in out and "step 1:" not in out

    plain = TrainProgress(False)
    plain({"step": 10, "loss": 0.5, "applied": True, "lr": 1e-4, "tokens_per_s": 1.0,
           "total": 20})
    out, err = capsys.readouterr()
    assert "step 10: loss 0.5000" in out and err == ""


def test_progress_bars_are_off_without_a_terminal_and_with_quiet(monkeypatch):
    from mlx_kvlingo import progress
    from mlx_kvlingo_cli.common import show_progress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert not show_progress() and not progress.enabled(None)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert show_progress() and not show_progress(quiet=True) and progress.enabled(None)
    for name in ("train", "eval", "fetch-models"):
        assert "quiet" in {p.name for p in commands()[name].params}, name


def test_eval_windows_bar(capsys):
    """evaluate_translators draws a bar over its windows when asked."""
    import mlx.core as mx

    import mlx_kvlingo as kv
    from mlx_kvlingo.measure.evaluate import evaluate_translators

    src, _ = kv.load(str(TOY / "source"))
    tgt, _ = kv.load(str(TOY / "target"))
    t = kv.load_translator(TOY_TRANSLATOR)
    windows = [mx.array([[5 + (i + j) % 50 for j in range(24)]]) for i in range(3)]
    evaluate_translators(src, tgt, [t], windows, 16, progress=True)
    assert "context 16" in capsys.readouterr().err
    evaluate_translators(src, tgt, [t], windows, 16)
    assert capsys.readouterr().err == ""


@pytest.fixture(scope="module")
def quantized_toy(tmp_path_factory):
    """The built-in target saved MLX-quantized (8 bits) as an mlx-lm directory."""
    import json

    from mlx_lm.utils import load as mlx_lm_load
    from mlx_lm.utils import quantize_model, save

    model, tok = mlx_lm_load(str(TOY / "target"))
    config = json.loads((TOY / "target" / "config.json").read_text())
    model, config = quantize_model(model, config, 32, 8)
    out = tmp_path_factory.mktemp("q") / "target-8bit"
    save(out, TOY / "target", model, tok, config)
    return out


def test_load_keeps_a_quantized_model_quantized_when_asked(quantized_toy):
    import mlx.core as mx
    import mlx.nn as nn

    from mlx_kvlingo.models.load import is_quantized, load

    if mx.default_device() != mx.cpu:
        pytest.skip("the CPU's defaults")
    plain, _ = load(str(quantized_toy))
    assert not is_quantized(plain) and plain.layers[0].mlp.down_proj.weight.dtype == mx.float32
    kept, _ = load(str(quantized_toy), keep_quantized=True)
    assert is_quantized(kept)
    assert isinstance(kept.layers[0].mlp.down_proj, nn.QuantizedLinear)
    cast, _ = load(str(quantized_toy), mx.bfloat16, keep_quantized=True)
    assert is_quantized(cast) and cast.layers[0].input_layernorm.weight.dtype == mx.bfloat16
    out = kept(mx.array([[1, 2, 3]]))
    assert out.shape == (1, 3, 1024)


def test_load_passes_mlx_lm_options_through(monkeypatch):
    import importlib

    load_module = importlib.import_module("mlx_kvlingo.models.load")
    seen = {}
    original = load_module.mlx_lm_load

    def spy(path, **kwargs):
        seen.update(kwargs)
        return original(path)

    monkeypatch.setattr(load_module, "mlx_lm_load", spy)
    load_module.load(str(TOY / "target"), adapter_path="adapters", revision="main",
                     tokenizer_config={"trust_remote_code": False})
    assert seen == {"adapter_path": "adapters", "revision": "main",
                    "tokenizer_config": {"trust_remote_code": False}}
    seen.clear()
    load_module.load(str(TOY / "target"))
    assert seen == {}


def test_inspect_and_switch_take_keep_quantized(quantized_toy):
    result = CliRunner().invoke(app, ["inspect", str(quantized_toy), "--gemm-size", "64",
                                      "--keep-quantized"])
    assert result.exit_code == 0, result.output
    assert "llama, 6 layers" in result.output
    for name in ("switch", "convert-cache", "compress", "chat"):
        assert "keep_quantized" in {p.name for p in commands()[name].params}, name


def test_convert_cache_takes_the_cache_file_once(tmp_path):
    args = ["convert-cache", "--translator", str(TOY_TRANSLATOR), "--source", "s",
            "--target", "t", "--out", str(tmp_path / "out.safetensors")]
    for extra in ([], [str(tmp_path / "a"), "--prompt-cache-file", str(tmp_path / "b")]):
        result = CliRunner().invoke(app, args + extra)
        assert result.exit_code == 1 and "IN or --prompt-cache-file" in result.output
