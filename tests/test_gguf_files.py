"""GGUF files built here with ggml's GGUFWriter: a tiny Llama survives the trip through the file,
every supported quantization dequantizes to what an independent decoder says, and bad files are
refused with a sentence that names the problem."""

import math
import os
import shutil
from pathlib import Path

import gguf
import llama_models
import numpy as np
import pytest
import torch
from conftest import tiny_model
from gguf_files import Q, add_tensor, write_llama, write_tensors
from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer
from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

from minipaged import CheckpointError, TokenizerError, load_model, load_tokenizer
from minipaged.formats.gguf_checkpoint import SUPPORTED_TYPES, cache_dir, dequantize
from minipaged.formats.gguf_tokenizer import GGUFTokenizer, gpt2_byte_spelling
from minipaged.model import rope_frequencies
from minipaged.formats.tokenizer import ChatFormat, Tokenizer, chat_format

LLAMA3_FILE = Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Every test dequantizes into its own cache folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def tiny():
    return tiny_model(dtype=torch.float32, use_scaled_rope=False)


# -- a whole model through the file ----------------------------------------------------------------
def test_f32_file_gives_back_the_same_model(tmp_path, tiny):
    path = write_llama(tmp_path / "tiny.gguf", tiny)
    loaded = load_model(path)
    assert loaded.args.n_kv_heads == 2 and loaded.args.hidden_dim == tiny.args.hidden_dim
    for name, t in tiny.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    tokens = torch.randint(0, 512, (2, 20))
    assert torch.equal(loaded(tokens), tiny(tokens))


def test_folder_holding_one_gguf_loads(tmp_path, tiny):
    write_llama(tmp_path / "m.gguf", tiny)
    assert load_model(tmp_path).args.dim == tiny.args.dim
    write_llama(tmp_path / "other.gguf", tiny)
    with pytest.raises(CheckpointError, match="holds 2 .gguf files"):
        load_model(tmp_path)


def test_tied_embeddings_and_hyperparameters_follow_the_file(tmp_path):
    model = tiny_model(dtype=torch.float32, use_scaled_rope=False, tie_word_embeddings=True,
                       rope_theta=100000.0, norm_eps=1e-6, n_kv_heads=1)
    loaded = load_model(write_llama(tmp_path / "tied.gguf", model))
    a = loaded.args
    assert a.tie_word_embeddings and loaded.output.weight is loaded.tok_embeddings.weight
    assert (a.rope_theta, a.norm_eps, a.n_kv_heads) == (100000.0, pytest.approx(1e-6), 1)
    tokens = torch.randint(0, 512, (1, 16))
    assert torch.equal(loaded(tokens), model(tokens))


def test_llama3_rope_scaling_comes_from_the_rope_freqs_tensor(tmp_path):
    """llama.cpp's converter stores Llama 3.1's scaling as one divisor per frequency."""
    factor, low, high, old = 32.0, 1.0, 4.0, 8192
    scaled = tiny_model(dtype=torch.float32, use_scaled_rope=True, rope_scale_factor=factor,
                        rope_low_freq_factor=low, rope_high_freq_factor=high,
                        rope_original_max_len=old, rope_theta=500000.0)
    d = scaled.args.head_dim
    divisors = []           # convert_hf_to_gguf's formula, written out here
    for i in range(0, d, 2):
        wavelen = 2 * math.pi * 500000.0 ** (i / d)
        if wavelen < old / high:
            divisors.append(1.0)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    plain = tiny_model(dtype=torch.float32, use_scaled_rope=False, rope_theta=500000.0)
    plain.load_state_dict(scaled.state_dict())
    loaded = load_model(write_llama(tmp_path / "r.gguf", plain, rope_freqs=divisors))
    torch.testing.assert_close(loaded.rope_freqs, rope_frequencies(scaled.args), rtol=1e-6, atol=0)
    tokens = torch.randint(0, 512, (1, 40))
    torch.testing.assert_close(loaded(tokens), scaled(tokens), rtol=1e-5, atol=1e-5)


def test_linear_rope_scaling(tmp_path, tiny):
    kv = {"llama.rope.scaling.type": ("linear", gguf.GGUFValueType.STRING),
          "llama.rope.scaling.factor": (4.0, gguf.GGUFValueType.FLOAT32)}
    loaded = load_model(write_llama(tmp_path / "lin.gguf", tiny, kv=kv))
    torch.testing.assert_close(loaded.rope_freqs, rope_frequencies(tiny.args) / 4.0)


def test_quantized_model_stays_within_the_quantization_step(tmp_path, tiny):
    loaded = load_model(write_llama(tmp_path / "q8.gguf", tiny, qtype=Q.Q8_0))
    for name, t in tiny.state_dict().items():
        if t.dim() == 2:      # Q8_0: 32 numbers share a scale max|x|/127, stored as fp16
            blocks = t.reshape(-1, 32)
            step = blocks.abs().amax(1, keepdim=True) / 127
            err = (loaded.state_dict()[name].reshape(-1, 32) - blocks).abs()
            assert (err <= 0.6 * step).all(), name     # half a step, plus the scale's rounding


def test_bf16_request_gives_bf16_weights(tmp_path, tiny):
    loaded = load_model(write_llama(tmp_path / "t.gguf", tiny), dtype=torch.bfloat16)
    assert loaded.tok_embeddings.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.layers[0].attention.wq.weight, tiny.layers[0].attention.wq.weight.bfloat16())


# -- each quantization type ---------------------------------------------------------------------
ROWS, COLS = 8, 512           # two 256-number super-blocks per row for the K-quants


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_round_trip_through_gguf_quantizer(tmp_path, qtype):
    """Quantized by gguf's quantizer, read back: the values are the original's, up to one
    quantization step (the block's scale: max|x|/127 for Q8_0, max|x|/8 or range/15 for 4 bits)."""
    rng = np.random.default_rng(int(qtype))
    x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    add_tensor(w, "x", x, qtype)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    got = dequantize(gguf.GGUFReader(path).tensors[0]).numpy()
    assert got.shape == (ROWS, COLS) and got.dtype == np.float32
    blocks, got_blocks = x.reshape(-1, 32), got.reshape(-1, 32)
    span = blocks.max(1, keepdims=True) - blocks.min(1, keepdims=True)
    amax = np.abs(blocks).max(1, keepdims=True)
    step = {Q.F32: 0 * amax, Q.F16: amax / 1024, Q.BF16: amax / 128, Q.Q8_0: amax / 127,
            Q.Q4_0: amax / 8, Q.Q4_1: span / 15, Q.Q5_0: amax / 16, Q.Q5_1: span / 31}[qtype]
    assert (np.abs(got_blocks - blocks) <= step * 1.001 + 1e-7).all()


def random_blocks(qtype, n_blocks, rng):
    """Random bytes in `qtype`'s block layout, with sane fp16 scales where the format has them."""
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
    fp16_at = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q2_K: [80, 82], Q.Q3_K: [108],
               Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}[qtype]
    for at in fp16_at:
        scale = rng.uniform(-0.1, 0.1, n_blocks).astype(np.float16)
        blocks[:, at:at + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_dequantize_matches_an_independent_decoder(tmp_path, qtype):
    """Random blocks of each format decode to what transformers' own (torch) decoder says."""
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, ROWS * COLS // elems, np.random.default_rng(int(qtype)))
    path = write_tensors(tmp_path / "k.gguf", {"w": (raw.reshape(ROWS, -1), qtype)})
    got = dequantize(gguf.GGUFReader(path).tensors[0])
    want = hf_dequantize(torch.from_numpy(raw.reshape(-1)), int(qtype)).reshape(ROWS, COLS)
    assert got.shape == (ROWS, COLS)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_every_supported_type_is_tested():
    tested = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
              "Q4_K", "Q5_K", "Q6_K"}
    assert set(SUPPORTED_TYPES) == tested


# -- bad files ----------------------------------------------------------------------------------
def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 this is a zip")
    with pytest.raises(CheckpointError, match=r"not a GGUF file: it starts with b'PK"):
        load_model(tmp_path / "x.gguf")
    assert not (tmp_path / "cache").exists()      # refused before the cache hashed or wrote


def test_other_architecture_is_named(tmp_path, tiny):
    path = write_llama(tmp_path / "q.gguf", tiny, arch="qwen2")
    with pytest.raises(CheckpointError, match="holds a 'qwen2' model; minipaged loads the 'llama'"):
        load_model(path)


def test_unsupported_quantization_is_named(tmp_path, tiny):
    path = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((512, 64 // 32 * 18), np.uint8), raw_dtype=Q.IQ4_NL)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    reader = gguf.GGUFReader(path)
    with pytest.raises(CheckpointError, match="stored as IQ4_NL, a quantization minipaged does not read"):
        dequantize(reader.tensors[0])


@pytest.mark.parametrize("keep", [0.5, 0.999, 60 / 1000])
def test_truncated_file(tmp_path, tiny, keep):
    path = write_llama(tmp_path / "cut.gguf", tiny)
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(CheckpointError, match="truncated"):
        load_model(path)


def test_missing_hyperparameter(tmp_path, tiny):
    path = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    add_tensor(w, "token_embd.weight", np.zeros((512, 64), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(CheckpointError, match="metadata lacks 'llama.attention.head_count'"):
        load_model(path)


# -- the cache ----------------------------------------------------------------------------------
@pytest.fixture
def readers(monkeypatch):
    """The files a GGUFReader is opened on (a load the cache serves opens none)."""
    opened, real_reader = [], gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda f, *a, **k: opened.append(Path(f).name)
                        or real_reader(f, *a, **k))
    return opened


def cached_folders(tmp_path):
    return sorted(p.name for p in (tmp_path / "cache" / "minipaged" / "gguf").iterdir()
                  if p.is_dir())


def test_second_load_comes_from_the_cache_until_the_bytes_change(tmp_path, tiny, readers):
    path = write_llama(tmp_path / "c.gguf", tiny)
    first = load_model(path)
    assert (cache_dir(path) / "weights-float32.safetensors").is_file() and readers == ["c.gguf"]
    again = load_model(path)
    assert readers == ["c.gguf"] and torch.equal(again.output.weight, first.output.weight)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))   # touched
    load_model(path)
    assert readers == ["c.gguf"]                          # hashed again: the same bytes
    old_folder = cache_dir(path).name
    other = tiny_model(seed=1, dtype=torch.float32, use_scaled_rope=False)
    write_llama(path, other)                              # new bytes at the same path
    assert torch.equal(load_model(path).output.weight, other.output.weight)
    assert readers == ["c.gguf", "c.gguf"]
    assert cached_folders(tmp_path) == [cache_dir(path).name] != [old_folder]   # the old one went


def test_copies_of_one_file_share_one_cache_folder(tmp_path, tiny, readers):
    """Each virtual environment installs its own copy of a packaged GGUF: a cache keyed by the
    path grew by the whole dequantized model with every new environment."""
    (tmp_path / "venv0").mkdir()
    first = write_llama(tmp_path / "venv0" / "m.gguf", tiny)
    load_model(first)
    for i in range(1, 4):
        copy = tmp_path / f"venv{i}" / "m.gguf"
        copy.parent.mkdir()
        copy.write_bytes(first.read_bytes())
        assert torch.equal(load_model(copy).output.weight, tiny.output.weight)
    assert readers == ["m.gguf"] and cached_folders(tmp_path) == [cache_dir(first).name]
    shutil.rmtree(tmp_path / "venv0")     # the environment whose copy made the folder is gone:
    assert torch.equal(load_model(copy).output.weight, tiny.output.weight)   # the folder serves on
    assert readers == ["m.gguf"] and cached_folders(tmp_path) == [cache_dir(copy).name]


def test_damaged_hash_index_is_rebuilt(tmp_path, tiny, readers):
    path = write_llama(tmp_path / "h.gguf", tiny)
    load_model(path)
    (tmp_path / "cache" / "minipaged" / "gguf" / "hashes.json").write_text('{"x": 1, "y": [')
    assert torch.equal(load_model(path).output.weight, tiny.output.weight)
    assert readers == ["h.gguf"]                          # hashed again, then served by the cache


def test_damaged_cache_is_ignored(tmp_path, tiny):
    path = write_llama(tmp_path / "d.gguf", tiny)
    load_model(path)
    (cache_dir(path) / "weights-float32.safetensors").write_bytes(b"garbage")
    assert torch.equal(load_model(path).output.weight, tiny.output.weight)


# -- the tokenizer --------------------------------------------------------------------------------
def llama3_gguf_metadata():
    """Llama 3's tokenizer as llama.cpp's converter stores it: tokens in GPT-2's byte
    spelling, 256 control tokens after them, the 'llama-bpe' split."""
    meta = MetaTokenizer(LLAMA3_FILE)
    spell = gpt2_byte_spelling()
    ranks = meta.model._mergeable_ranks
    tokens = [None] * len(ranks)
    for token, rank in ranks.items():
        tokens[rank] = "".join(spell[b] for b in token)
    specials = sorted(meta.special_tokens.items(), key=lambda kv: kv[1])
    return meta, {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe",
        "tokenizer.ggml.tokens": tokens + [name for name, _ in specials],
        "tokenizer.ggml.token_type": [1] * len(tokens) + [3] * len(specials),
        "tokenizer.ggml.bos_token_id": 128000, "tokenizer.ggml.eos_token_id": 128009,
        "tokenizer.chat_template": "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>' }}",
    }


LLAMA3_TEXTS = ["Hello, world!", "I'm YOU'RE we'Ve 'S", "1234567 3.14", "a  \n\n  b\t\tc",
                "def f(x):\n    return x ** 2\n", "日本語 😀 👨‍👩‍👧 e\u0301", "<|eot_id|> typed",
                "  leading and trailing  ", "\x00\x04\x7f"]


def test_llama3_vocabulary_in_gguf_spelling_encodes_like_meta():
    meta, metadata = llama3_gguf_metadata()
    tok = GGUFTokenizer(metadata, "llama3.gguf")
    assert tok.n_words == 128256 and tok.stop_tokens == [128009]
    for text in LLAMA3_TEXTS:
        ids = tok.encode(text)
        assert ids == meta.encode(text, bos=False, eos=False, allowed_special=set()), text
        assert tok.decode(ids) == text
    dialog = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": " 12+30? "}]
    fmt = chat_format(tok)
    assert isinstance(fmt, ChatFormat)
    assert fmt.encode_dialog_prompt(dialog) == ChatFormat(Tokenizer(LLAMA3_FILE)).encode_dialog_prompt(dialog)


def test_tokenizer_from_a_gguf_file_and_its_errors(tmp_path, tiny):
    spell = gpt2_byte_spelling()
    tokens = [spell[b] for b in range(256)] + ["Ġt", "he", "Ġthe"] + ["<|im_start|>", "<|im_end|>"]
    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1] * 259 + [3, 3],
            "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he"], "tokenizer.ggml.eos_token_id": 260,
            "tokenizer.chat_template": "{{'<|im_start|>' + role}}"}
    tok = load_tokenizer(write_llama(tmp_path / "t.gguf", tiny, tokenizer=base))
    assert tok.encode(" the 42") == [258, 32, 52, 50] and tok.stop_tokens == [260]
    assert chat_format(tok).encode_dialog_prompt([{"role": "user", "content": "the"}]) == \
        [259, *tok.encode("user\nthe"), 260, 10, 259, *tok.encode("assistant\n")]
    for change, message in [({"tokenizer.ggml.model": "llama"}, "SentencePiece"),
                            ({"tokenizer.ggml.pre": "qwen2"}, "pre-tokenizer 'qwen2'"),
                            ({"tokenizer.ggml.merges": ["h e", "Ġ t", "Ġt he"]}, "id order")]:
        path = write_llama(tmp_path / f"bad{len(message)}.gguf", tiny, tokenizer={**base, **change})
        with pytest.raises(TokenizerError, match=message):
            load_tokenizer(path)
    no_template = {k: v for k, v in base.items() if k != "tokenizer.chat_template"}
    tok = load_tokenizer(write_llama(tmp_path / "base.gguf", tiny, tokenizer=no_template))
    with pytest.raises(TokenizerError, match="not a chat model"):
        chat_format(tok)
