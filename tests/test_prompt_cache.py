"""Converting mlx-lm prompt-cache files between models, checked with mlx-lm itself."""

import contextlib
import importlib
import io
import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest
import typer
from mlx_lm.models.cache import KVCache, load_prompt_cache
from tiny import identity_translator
from typer.testing import CliRunner

from mlx_kvlingo.models.cache import read_layer
from mlx_kvlingo.switching.prompt_cache import (
    cache_prompt_tokens,
    convert_prompt_cache_file,
    native_dtype,
)
from mlx_kvlingo.translator.maps import Translator

PROMPT = ("Return a new list containing all items from the iterable in ascending order. "
          "A custom key function can be supplied to customize the sort order, and the "
          "reverse flag can be set to request the result in descending order.")
CLI = ("import mlx_kvlingo, typer; from mlx_kvlingo_cli.session_cmds import register; "
       "app = typer.Typer(add_completion=False); register(app); app()")


def mlx_lm_main(module, *argv):
    """Run an mlx-lm command-line entry point in-process; return its stdout."""
    mod = importlib.import_module(module)
    out, old = io.StringIO(), sys.argv
    sys.argv = [module, *map(str, argv)]
    try:
        with contextlib.redirect_stdout(out):
            mod.main()
    finally:
        sys.argv = old
    return out.getvalue()


def cache_prompt(model_dir, path, prompt=PROMPT):
    mlx_lm_main("mlx_lm.cache_prompt", "--model", model_dir, "--prompt-cache-file", path,
                "--prompt", prompt)


def generate_text(model_dir, cache_file, prompt=" The sort is stable", n=12):
    out = mlx_lm_main("mlx_lm.generate", "--model", model_dir, "--prompt-cache-file",
                      cache_file, "--prompt", prompt, "--max-tokens", n)
    return out.split("==========")[1]


def test_exact_conversion_reproduces_the_native_cache_file(toy_pair, toy_pair_dirs, tmp_path):
    """Through an exact (identity) translator the converted file is the cache the
    model itself wrote, and mlx_lm.generate continues from both alike."""
    _, _, tgt, tok = toy_pair
    target = str(toy_pair_dirs[1])
    native_file, converted = tmp_path / "native.safetensors", tmp_path / "converted.safetensors"
    cache_prompt(target, native_file)
    report = convert_prompt_cache_file(native_file, converted, tgt, tgt, identity_translator(tgt, tok),
                                       target, tok, PROMPT, native_dtype(target))
    n = len(cache_prompt_tokens(tok, PROMPT))
    assert (report.tokens, report.translated, report.native) == (n, n - 1, 1)
    want, meta_in = load_prompt_cache(str(native_file), return_metadata=True)
    got, meta = load_prompt_cache(str(converted), return_metadata=True)
    assert meta["model"] == target and meta["tokenizer_config"] == meta_in["tokenizer_config"]
    assert json.loads(meta["mlx_kvlingo"])["tokens"] == n
    assert all(type(c) is KVCache for c in got) and len(got) == len(want)
    for a, b in zip(want, got):
        assert a.offset == b.offset == n and b.keys.dtype == a.keys.dtype == mx.float16
        (ka, va, _), (kb, vb, _) = read_layer(a), read_layer(b)
        ka, kb, va, vb = (x.astype(mx.float32) for x in (ka, kb, va, vb))
        assert mx.abs(ka - kb).max().item() <= 2e-2 * mx.abs(ka).max().item()
        assert mx.abs(va - vb).max().item() <= 2e-2 * mx.abs(va).max().item()
    assert generate_text(target, converted) == generate_text(target, native_file)


@pytest.fixture(scope="module")
def pair_translator():
    """The built-in pair's shipped stage-2 translator (its stage-1 fit carries
    almost none of what the target's context is worth: builtin-pair.md)."""
    from mlx_kvlingo.pairs import toy

    return toy.STAGE2_TRANSLATOR


def test_convert_cache_command_hands_a_cache_to_the_other_model(
        pair_translator, toy_pair, toy_pair_dirs, tmp_path):
    src_dir, tgt_dir = map(str, toy_pair_dirs)
    in_file, out_file = tmp_path / "small.safetensors", tmp_path / "large.safetensors"
    cache_prompt(src_dir, in_file)
    proc = subprocess.run(
        [sys.executable, "-c", CLI, "convert-cache", str(in_file), "--translator",
         str(pair_translator), "--source", src_dir, "--target", tgt_dir, "--out",
         str(out_file), "--prompt", PROMPT],
        capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "computed by the target" in proc.stdout
    cache, meta = load_prompt_cache(str(out_file), return_metadata=True)
    assert meta["model"] == tgt_dir and len(cache) == 6  # the target's layers
    assert generate_text(tgt_dir, out_file).strip()

    # The target really continues the cached text: the true continuation is likelier
    # from the converted cache than from no context at all.
    _, _, tgt, tok = toy_pair
    assert cache[0].offset == len(cache_prompt_tokens(tok, PROMPT))
    cont = mx.array(tok.encode(" A custom key function can be supplied to customize "
                               "the sort order."))[None]
    for c in cache:
        c.keys, c.values = c.keys.astype(mx.float32), c.values.astype(mx.float32)

    def nll(cache):
        logits = tgt(cont[:, :-1], cache=cache)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return -mx.take_along_axis(lp, cont[:, 1:, None], axis=-1).mean().item()

    assert nll(cache) < nll(None) - 0.1


def run_cli(*args):
    app = typer.Typer(add_completion=False)
    from mlx_kvlingo_cli.session_cmds import register

    register(app)
    return CliRunner().invoke(app, [str(a) for a in args])


def test_convert_cache_refuses_bad_input(pair_translator, toy_pair_dirs, tmp_path):
    src_dir, tgt_dir = map(str, toy_pair_dirs)
    in_file = tmp_path / "small.safetensors"
    cache_prompt(src_dir, in_file)
    base = ["convert-cache", in_file, "--translator", pair_translator, "--source", src_dir,
            "--target", tgt_dir, "--out", tmp_path / "out.safetensors"]
    cases = [
        ([], "Give the prompt"),  # the native prefix needs the first token ids
        (["--prompt", PROMPT + " More."], "is not the prompt that was cached"),
        # Same length, other words: the source's own keys for them differ from the file's.
        (["--prompt", PROMPT.replace("a new list", "a new set")], "does not match the cached text"),
    ]
    for extra, message in cases:
        r = run_cli(*base, *extra)
        assert r.exit_code == 1, r.output
        assert message in r.output and "Traceback" not in r.output
    # A file mlx-lm did not write, and a cache from another model than --source.
    r = run_cli("convert-cache", pair_translator, *base[2:], "--prompt", PROMPT)
    assert r.exit_code == 1 and "not an mlx-lm prompt-cache file" in r.output
    other = tmp_path / "large.safetensors"
    cache_prompt(tgt_dir, other)
    r = run_cli("convert-cache", other, *base[2:], "--prompt", PROMPT)
    assert r.exit_code == 1 and "Was it made by another model?" in r.output
    assert not (tmp_path / "out.safetensors").exists()


def twin_model_dir(model_dir, out):
    """A copy of a model directory whose tokenizer splits text alike but differs
    (an extra special token): a different tokenizer as far as translators go."""
    import shutil

    from tokenizers import AddedToken, Tokenizer

    shutil.copytree(model_dir, out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<|extra|>", special=True)])
    tok.save(str(out / "tokenizer.json"))
    return out


def test_cross_tokenizer_conversion_through_exact_maps_continues_like_the_native_cache(
        toy_pair_dirs, tmp_path):
    from mlx_kvlingo.models.load import load

    target = str(toy_pair_dirs[1])
    twin = str(twin_model_dir(toy_pair_dirs[1], tmp_path / "twin"))
    src, stok = load(target)
    tgt, ttok = load(twin)
    t = Translator.for_models(src, tgt, stok, ttok)
    assert t.cross_tokenizer
    for m in t.k_maps + t.v_maps:
        m.weight = mx.eye(m.weight.shape[0])
    t.save(tmp_path / "cross.safetensors")
    in_file, out_file, native = (tmp_path / f"{n}.safetensors" for n in ("in", "out", "native"))
    cache_prompt(target, in_file)
    cache_prompt(twin, native)
    r = run_cli("convert-cache", in_file, "--translator", tmp_path / "cross.safetensors",
                "--source", target, "--target", twin, "--out", out_file)
    assert r.exit_code == 1 and "--prompt" in r.output
    r = run_cli("convert-cache", in_file, "--translator", tmp_path / "cross.safetensors",
                "--source", target, "--target", twin, "--out", out_file, "--prompt", PROMPT)
    assert r.exit_code == 0, r.output
    assert generate_text(twin, out_file) == generate_text(twin, native)
