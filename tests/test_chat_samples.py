"""Stage 2 on chats: coding chats (data.code_chats), their samples with the target's
own answers and weights (train.chat_samples), and the weighted KL they train with."""

import json
import re
from dataclasses import replace

import mlx.core as mx
import pytest
from tiny import identity_translator, native_greedy

from mlx_kvlingo.data.code_chats import KINDS, code_chats
from mlx_kvlingo.errors import KvlingoError
from mlx_kvlingo.train.chat_samples import answer_weights, build_chat_samples, chat_ids
from mlx_kvlingo.train.distill import DistillConfig, kl_loss
from mlx_kvlingo.train.loop import RunConfig, train
from mlx_kvlingo.train.samples import ChatSamples, pair_data

CODE = ["\n\n".join(f"def step_{p}_{i}(value):\n    # move the value along\n"
                    f"    result = value + {i}\n    if result > {p}:\n        result -= {p}\n"
                    f"    return result" for i in range(12)) for p in range(40)]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def words(text):
    return len(text.split())


def test_chats_cycle_the_kinds_and_ask_about_their_own_paste():
    chats = code_chats(16, words, lengths=(120, 200), seed=2, code=CODE)
    assert [c.kind for c in chats[:len(KINDS)]] == list(KINDS)
    for c in chats:
        assert "```python" in c.paste or c.paste.startswith("```python")
        code = c.paste.split("```python\n", 1)[1].split("\n```", 1)[0]
        if c.kind == "explain":
            name = re.search(r"`(\w+)`", c.question).group(1)
            assert f"def {name}(" in code
        if c.kind == "prints":
            name = re.search(r"`(\w+)\(\)`", c.question).group(1)
            assert f"def {name}():" in code and "print(" in code
    # Several phrasings of the paste, deterministic in the seed.
    assert len({c.paste.split("```")[0] for c in chats}) > 1
    assert code_chats(16, words, lengths=(120, 200), seed=2, code=CODE) == chats
    assert code_chats(16, words, lengths=(120, 200), seed=3, code=CODE) != chats


def test_answer_weights_favour_tokens_that_need_the_paste():
    w = answer_weights([0.1, 0.1, 2.0, 0.5], [0.1, 3.1, 2.5, 20.0], floor=0.25, cap=4.0)
    assert sum(w) / len(w) == pytest.approx(1.0)
    assert w[0] < w[2] < w[1] < w[3]  # no gain < 0.5 nats < 3 nats < capped at 4
    assert w[0] == pytest.approx(0.25 / ((0.25 + 3.25 + 0.75 + 4.25) / 4))
    assert answer_weights([1.0], [0.2]) == [1.0]  # a token the paste makes harder: the floor


@pytest.fixture(scope="module")
def chat_pair(toy_pair_dirs):
    """The built-in pair with a chat template, loaded afresh (the session's own copy
    of its tokenizers stays as it is for the other tests)."""
    from mlx_kvlingo.models.load import load

    src, stok = load(toy_pair_dirs[0])
    tgt, ttok = load(toy_pair_dirs[1])
    for tok in (stok, ttok):
        tok._tokenizer.chat_template = TEMPLATE
    return src, stok, tgt, ttok


@pytest.fixture(scope="module")
def samples_file(chat_pair, tmp_path_factory):
    src, tok, tgt, _ = chat_pair
    out = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    chats = code_chats(10, lambda t: len(tok.encode(t)), lengths=(60, 90), seed=0, code=CODE)
    assert build_chat_samples(src, tok, tgt, chats, out, 4, 6, log=lambda m: None) == 10
    return out, chats


def test_a_sample_is_the_chat_up_to_the_first_answer_then_the_targets_own_answer(
        chat_pair, samples_file):
    src, tok, tgt, _ = chat_pair
    out, chats = samples_file
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(10))
    for r, chat in zip(rows, chats):
        text = tok.decode(r["context"] + r["continuation"])
        assert text.startswith(tok.decode(chat_ids(tok, [{"role": "user", "content": chat.paste}],
                                                   True)))
        asked = sum(1 for w in r["weights"] if w == 0.0)
        question = tok.decode(r["continuation"][:asked])
        assert chat.question in question and question.endswith("<|assistant|>")
        answer = r["continuation"][asked:]
        assert answer and len(answer) <= 6 and len(r["weights"]) == len(r["continuation"])
        assert sum(r["weights"][asked:]) / len(answer) == pytest.approx(1.0, rel=1e-5)
        # The answer is the target's own greedy continuation of the whole chat.
        assert native_greedy(tgt, tok, r["context"] + r["continuation"][:asked], 6) == answer


def test_a_rerun_of_the_build_goes_on_where_it_stopped(chat_pair, samples_file, tmp_path):
    src, tok, tgt, _ = chat_pair
    out, chats = samples_file
    partial = tmp_path / "part.jsonl"
    partial.write_text("".join(out.read_text().splitlines(keepends=True)[:4]))
    assert build_chat_samples(src, tok, tgt, chats, partial, 4, 6, log=lambda m: None) == 10
    assert partial.read_text() == out.read_text()  # the same samples, none twice


def test_a_model_without_a_chat_template_is_refused(toy_pair_dirs, tmp_path):
    from mlx_kvlingo.models.load import load

    m, tok = load(toy_pair_dirs[1])  # a fresh copy: no template
    tok._tokenizer.chat_template = None
    chats = code_chats(1, words, lengths=(60,), code=CODE)
    with pytest.raises(KvlingoError, match="chat template"):
        build_chat_samples(m, tok, m, chats, tmp_path / "c.jsonl")
    assert not (tmp_path / "c.jsonl").exists()


def test_chat_samples_hold_out_chats_and_draw_by_step(chat_pair, samples_file):
    src, stok, tgt, ttok = chat_pair
    out, _ = samples_file
    pair = pair_data(f"chats:{out}", stok, ttok)
    assert isinstance(pair, ChatSamples)
    train_ids = {r["index"] for r in pair.train_rows}
    held = {r["index"] for r in pair.heldout_rows}
    assert train_ids and held and not train_ids & held
    config = RunConfig(distill=DistillConfig(batch_size=1, accumulate=3, seed=1))
    a, b = pair.step_samples(config, 5), pair.step_samples(config, 5)
    assert len(a) == 3 and all(mx.array_equal(x[0], y[0]) for x, y in zip(a, b))
    # An epoch's steps hold every training chat once.
    n = len(pair.train_rows)
    epoch = [c[0].tolist() for step in range(n) for c in pair.step_samples(
        RunConfig(distill=DistillConfig(batch_size=1, accumulate=1, seed=1)), step)]
    assert sorted(epoch) == sorted([[r["context"]] for r in pair.train_rows])
    t = identity_translator(tgt, ttok)
    for batch in pair.step_batches(tgt, tgt, t, config, 5):  # the identity: tgt to tgt
        assert batch.weights.shape == batch.continuation.shape
    with pytest.raises(KvlingoError, match="chat-data"):
        pair_data(f"chats:{out}.missing", stok, ttok)


def test_the_kl_counts_each_token_by_its_weight(chat_pair, samples_file):
    src, stok, tgt, ttok = chat_pair
    out, _ = samples_file
    pair = pair_data(f"chats:{out}", stok, ttok)
    config = RunConfig(distill=DistillConfig(batch_size=1, accumulate=1))
    batch = pair.step_batches(tgt, tgt, identity_translator(tgt, ttok, scale=0.5), config, 0)[0]
    L = batch.continuation.shape[1]
    plain = kl_loss(identity_translator(tgt, ttok, scale=0.5), tgt, replace(batch, weights=None))
    ones = kl_loss(identity_translator(tgt, ttok, scale=0.5), tgt,
                   replace(batch, weights=mx.ones((1, L))))
    assert ones.item() == pytest.approx(plain.item(), rel=1e-5)
    # Only the last token counts: its KL alone, whatever the others' teacher says.
    last = mx.zeros((1, L)).at[0, L - 1].add(1.0)
    spoiled = replace(batch, weights=last,
                      teacher=mx.concatenate([mx.zeros_like(batch.teacher[:, :-1]) - 3.0,
                                              batch.teacher[:, -1:]], axis=1))
    t = identity_translator(tgt, ttok, scale=0.5)
    assert kl_loss(t, tgt, spoiled).item() == pytest.approx(
        kl_loss(t, tgt, replace(batch, weights=last)).item(), rel=1e-5)
    assert kl_loss(t, tgt, replace(batch, weights=last)).item() != pytest.approx(plain.item())


def test_stage_two_trains_on_chats_through_the_store(chat_pair, samples_file, tmp_path):
    src, stok, tgt, ttok = chat_pair
    out, _ = samples_file
    pair = pair_data(f"chats:{out}", stok, ttok)
    config = RunConfig(distill=DistillConfig(steps=3, batch_size=1, accumulate=2, lr=1e-3),
                       eval_every=0, checkpoint_every=0, store_pool=2, eval_windows=8,
                       eval_context=32, continuation_len=8)
    t = identity_translator(tgt, ttok, scale=0.5)
    summary = train(tgt, tgt, t, pair, tmp_path / "t.safetensors", config, corpus_id="chats")
    assert summary["steps"] == 3 and (tmp_path / "t.safetensors").exists()
    shards = sorted((tmp_path / "t.safetensors.store").glob("step-*.safetensors"))
    assert len(shards) == 2
    arrays = mx.load(str(shards[0]))
    assert "mb0.weights" in arrays and arrays["mb0.weights"].shape == arrays["mb0.continuation"].shape


@pytest.mark.parametrize("rank", [0, 2])
def test_stage_two_on_chats_lowers_a_compressed_translators_loss(chat_pair, samples_file,
                                                                   tmp_path, rank):
    """As the shipped Qwen files are made better: a compressed file (one shared
    projection per kind) trained on chat samples, whole (rank 0) or by a low-rank
    correction of each layer's map over the frozen projection, its weighted KL
    falling."""
    from mlx_kvlingo.translator.compress import calibration_features, compress_translator
    from mlx_kvlingo.translator.maps import load_translator

    from mlx_kvlingo.translator.maps import Translator

    src, stok, tgt, ttok = chat_pair
    out, _ = samples_file
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # The identity with a token map on every layer, folded under the projection.
    full = Translator.for_models(tgt, tgt, ttok, ttok, token_layers=range(len(tgt.layers)))
    for lin in full.k_maps + full.v_maps:
        lin.weight = mx.eye(lin.weight.shape[0])
    for lin in full.k_tok + full.v_tok:
        lin.weight = mx.zeros(lin.weight.shape)
    feats = calibration_features(tgt, [r["context"][:48] for r in rows], full.source_layers,
                                 target=tgt)
    small, _ = compress_translator(full, feats, 6, 6, fold_tokens=True)  # lossy
    assert small.spec.shared_tokens
    start = tmp_path / "small.safetensors"
    small.save(start)
    config = RunConfig(distill=DistillConfig(steps=16, batch_size=1, accumulate=2,
                                             lr=1e-4 if not rank else 3e-3, warmup=0.0,
                                             rank=rank),
                       eval_every=0, checkpoint_every=0, store_pool=2, eval_windows=8,
                       eval_context=32, continuation_len=8)
    pair = pair_data(f"chats:{out}", stok, ttok)
    trained = tmp_path / "chat.safetensors"
    train(tgt, tgt, load_translator(start), pair, trained, config, corpus_id="chats")
    log = [json.loads(line) for line in (tmp_path / "chat.safetensors.log.jsonl")
           .read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert len(losses) == 16
    # The same two pool steps each epoch: the last epoch's against the first's.
    assert sum(losses[-2:]) < 0.9 * sum(losses[:2])
    after = load_translator(trained)
    assert after.spec.shared_rank == small.spec.shared_rank
    if rank:  # the projection stayed as it was; each map moved by at most rank 2
        for a, b in ((after.k_shared, small.k_shared), (after.v_shared, small.v_shared)):
            assert mx.array_equal(a.weight, b.weight)
        moved = after.v_maps[0].weight - small.v_maps[0].weight
        singular = mx.linalg.svd(moved, stream=mx.cpu)[1]
        assert singular[0] > 0 and (singular[rank:] < 1e-5 * singular[0]).all()
