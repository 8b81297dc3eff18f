"""Bad input gets a clear error and changes nothing.

Each case runs the command a user would run and checks the message, the exit status,
and that no output file was written or an existing one left byte-for-byte intact.
"""

import shutil

import pytest
from test_cli import run_cli

from mlx_kvlingo.translator.maps import Translator


@pytest.fixture(scope="module")
def pair_translator(toy_pair_dirs, tmp_path_factory):
    from mlx_kvlingo.models.load import load

    src, stok = load(toy_pair_dirs[0])
    tgt, ttok = load(toy_pair_dirs[1])
    t = Translator.for_models(src, tgt, stok, ttok)
    path = tmp_path_factory.mktemp("bad") / "pair.safetensors"
    t.save(path)
    return path


def _fails(proc, *phrases):
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    for p in phrases:
        assert p in proc.stderr, (p, proc.stderr)


def test_empty_corpus_writes_nothing(toy_pair_dirs, tmp_path):
    corpus = tmp_path / "empty.txt"
    corpus.write_text("")
    out = tmp_path / "t.safetensors"
    _fails(run_cli("fit", "--source", toy_pair_dirs[0], "--target", toy_pair_dirs[1],
                   "--out", out, "--corpus", corpus, check=False), "is empty")
    assert not out.exists() and list(tmp_path.iterdir()) == [corpus]


def test_binary_and_malformed_corpora(toy_pair_dirs, tmp_path):
    binary = tmp_path / "data.txt"
    binary.write_bytes(b"\x00\x01\x02" * 100)
    bad_json = tmp_path / "chat.jsonl"
    bad_json.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{oops\n')
    for corpus, phrase in ((binary, "looks binary"), (bad_json, "chat.jsonl:2: malformed JSON")):
        out = tmp_path / "t.safetensors"
        _fails(run_cli("fit", "--source", toy_pair_dirs[0], "--target", toy_pair_dirs[1],
                       "--out", out, "--corpus", corpus, check=False), phrase)
        assert not out.exists()


def test_damaged_init_translator_leaves_existing_output_intact(toy_pair_dirs, pair_translator, tmp_path):
    out = tmp_path / "out.safetensors"
    shutil.copy(pair_translator, out)
    before = out.read_bytes()
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(pair_translator.read_bytes()[:-100])  # truncated
    _fails(run_cli("train", "--stage", "2", "--source", toy_pair_dirs[0], "--target",
                   toy_pair_dirs[1], "--init", damaged, "--out", out, "--steps", 1,
                   check=False), "damaged.safetensors", "invalid entry in the header")
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged.safetensors", "out.safetensors"]


def test_translator_for_another_pair_names_the_differences(toy_pair_dirs, pair_translator, tmp_path):
    report = tmp_path / "report.json"
    proc = run_cli("eval", "--source", toy_pair_dirs[1], "--target", toy_pair_dirs[0],
                   "--translator", pair_translator, "--json", report, check=False)
    _fails(proc, "does not fit", "source model_type: translator qwen3, model llama",
           "target layers: translator 6, model 4")
    assert not report.exists()


def test_shared_tokenizer_translator_refused_for_other_tokenizers(toy_pair_dirs, pair_translator, tmp_path):
    """Same geometry, different vocabulary: a shared-tokenizer translator cannot align."""
    from mlx_kvlingo.data import corpus as data
    from mlx_kvlingo.pairs import toy

    other = tmp_path / "target-other-tokenizer"
    shutil.copytree(toy_pair_dirs[1], other)
    docs = [("d", "".join(chr(ord("a") + (i * 7) % 26) for i in range(5000)) + " zebra quokka")]
    toy.build_tokenizer(docs + data.stdlib_documents()[:5], tmp_path / "tok", vocab_size=1024)
    shutil.copy(tmp_path / "tok" / "tokenizer.json", other / "tokenizer.json")
    _fails(run_cli("switch", "--source", toy_pair_dirs[0], "--target", other, "--translator",
                   pair_translator, "--prompt", "hello world", check=False),
           "target tokenizer: vocabulary differs",
           "tokenizers differ but the translator was trained for a shared tokenizer")


def test_prompt_problems(toy_pair_dirs, pair_translator, tmp_path):
    common = ("switch", "--source", toy_pair_dirs[0], "--target", toy_pair_dirs[1],
              "--translator", pair_translator)
    _fails(run_cli(*common, "--prompt", "   ", "--raw", check=False), "The prompt is empty")
    long_prompt = tmp_path / "long.txt"
    long_prompt.write_text("word " * 6000)
    _fails(run_cli(*common, "--prompt-file", long_prompt, "--raw", check=False),
           "the target model handles at most 4096 positions")


def test_unknown_hub_model_while_offline(tmp_path):
    out = tmp_path / "t.safetensors"
    _fails(run_cli("fit", "--source", "nobody-xyz/no-such-model", "--target",
                   "nobody-xyz/no-such-model", "--out", out, check=False),
           "Could not load model 'nobody-xyz/no-such-model'", "HF_HUB_OFFLINE=1")
    assert not out.exists()
