"""Checkpoints that lie about themselves: each is refused when it is loaded, with one named error
(CheckpointError or TokenizerError) whose sentence names what is wrong, never a raw exception
from deep inside, never a hang, and never a model that loads and then answers nonsense.

Probes by class (`PROBES`): tensors that disagree with their config, tensors that are not
floating point, Meta files that are not a dict of tensors, values out of range that shape the
model (in every format), GGUF metadata of the wrong kind or missing, GGUF tokenizers whose
metadata lies, a damaged GGUF cache, files that are not regular files, and a tokenizer that does
not belong to its model."""

import json
import os
import signal
import socket

import gguf
import numpy as np
import pytest
import torch
from conftest import tiny_model
from gguf_files import write_llama
from safetensors.torch import load_file, save_file

from minipaged import CheckpointError, TokenizerError, load_model, load_tokenizer, save_model
from minipaged.formats import DEFAULT_MODEL_DIR
from minipaged.formats.gguf_checkpoint import cache_dir
from minipaged.formats.gguf_tokenizer import gpt2_byte_spelling

V = gguf.GGUFValueType
NAMED = (CheckpointError, TokenizerError)


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture(autouse=True)
def no_hang():
    """A probe that blocks (opening a FIFO waits for a writer) fails instead of hanging."""
    def hung(signum, frame):
        raise TimeoutError("the load blocked for 60 s")
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def tiny():
    return tiny_model(dtype=torch.float32)


# -- builders: each writes a lying checkpoint in `d` and returns what to load --------------------
def hf(d, tensors=None, config=None):
    path = save_model(tiny(), d / "hf")
    if tensors:
        st = load_file(path / "model.safetensors")
        tensors(st)
        save_file(st, path / "model.safetensors")
    if config:
        cfg = json.loads((path / "config.json").read_text())
        config(cfg)
        (path / "config.json").write_text(json.dumps(cfg))
    return path


def meta(d, state=None, params=None):
    path = save_model(tiny(), d / "meta", layout="meta")
    if state is not None:
        torch.save(state, path / "consolidated.00.pth")
    if params:
        p = json.loads((path / "params.json").read_text())
        p.update(params)
        (path / "params.json").write_text(json.dumps(p))
    return path


def gguf_file(d, kv=None, drop=(), tokenizer=None, model=None):
    """A GGUF file with `kv` overriding metadata ({key: (value, type)}), keys in `drop` left out."""
    path = write_llama(d / "m.gguf", model or tiny(), kv=kv, tokenizer=tokenizer)
    if drop:
        reader = gguf.GGUFReader(path)
        out = d / "dropped.gguf"
        w = gguf.GGUFWriter(str(out), "llama")
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture" or key in drop:
                continue
            value, vtype = field.contents(), field.types[0]
            if vtype == V.ARRAY:
                w.add_array(key, value)
            else:
                w.add_key_value(key, value, vtype)
        for t in reader.tensors:
            w.add_tensor(t.name, np.array(t.data), raw_shape=list(reversed(t.shape.tolist())),
                         raw_dtype=t.tensor_type)
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
        return out
    return path


def set_(key, value):
    return lambda m: m.__setitem__(key, value)


def tensor(name, value):
    return lambda st: st.__setitem__(name, value)


SPELL = gpt2_byte_spelling()
TOKENS = [SPELL[b] for b in range(256)] + ["Ġt", "he", "Ġthe", "<|im_start|>", "<|im_end|>"]
BASE_TOK = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
            "tokenizer.ggml.tokens": TOKENS, "tokenizer.ggml.token_type": [1] * 259 + [3, 3],
            "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he"],
            "tokenizer.ggml.eos_token_id": 260,
            "tokenizer.chat_template": "{{'<|im_start|>' + role}}{{'<|im_end|>'}}"}


def gguf_tok(d, **change):
    tok = {**BASE_TOK, **{k.replace("__", "."): v for k, v in change.items()}}
    return write_llama(d / "t.gguf", tiny(), tokenizer={k: v for k, v in tok.items()
                                                         if v is not None})


def cached(d, damage):
    """A GGUF file loaded once (cached), then its cache folder damaged by `damage(folder)`."""
    path = write_llama(d / "c.gguf", tiny())
    load_model(path)
    damage(cache_dir(path))
    return path


def fifo(d):
    os.mkfifo(d / "pipe.gguf")
    return d / "pipe.gguf"


def sock(d):
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(d / "sock.gguf"))
    return d / "sock.gguf"


def link(d, target):
    (d / "dev.gguf").symlink_to(target)
    return d / "dev.gguf"


def in_folder(d, make):
    (d / "folder").mkdir()
    make(d / "folder")
    return d / "folder"


# class -> {probe name: (builder(d), what to call, words the sentence holds)}
M, T = load_model, load_tokenizer
PROBES = {
    "hf tensors vs config": {
        "q rows not heads x head_dim": (lambda d: hf(d, tensor(
            "model.layers.0.self_attn.q_proj.weight", torch.zeros(60, 64))), M, "q_proj"),
        "k rows odd": (lambda d: hf(d, tensor(
            "model.layers.1.self_attn.k_proj.weight", torch.zeros(33, 64))), M, "k_proj"),
        "q a vector": (lambda d: hf(d, tensor(
            "model.layers.0.self_attn.q_proj.weight", torch.zeros(64))), M, "q_proj"),
        "q a 3-d tensor": (lambda d: hf(d, tensor(
            "model.layers.0.self_attn.q_proj.weight", torch.zeros(4, 16, 64))), M, "q_proj"),
        "q bias": (lambda d: hf(d, tensor(
            "model.layers.0.self_attn.q_proj.bias", torch.zeros(64))), M, "wq.bias"),
        "config heads disagree with q": (lambda d: hf(d, config=lambda c: (
            c.update(num_attention_heads=8), c.pop("head_dim"))), M, "shape"),
        "config width disagrees": (lambda d: hf(d, config=lambda c: (
            c.update(hidden_size=128), c.pop("head_dim"))), M, "shape"),
        "config kv heads disagree with k": (lambda d: hf(d, config=set_(
            "num_key_value_heads", 4)), M, "k_proj"),
    },
    "tensors not floating point": {
        "int32 embedding": (lambda d: hf(d, tensor(
            "model.embed_tokens.weight", torch.zeros(512, 64, dtype=torch.int32))), M, "int32"),
        "bool norm": (lambda d: hf(d, tensor(
            "model.norm.weight", torch.ones(64, dtype=torch.bool))), M, "bool"),
        "int8 wq": (lambda d: hf(d, tensor("model.layers.0.self_attn.q_proj.weight",
                                           torch.zeros(64, 64, dtype=torch.int8))), M, "int8"),
        "int64 meta norm": (lambda d: meta(d, {**tiny().state_dict(),
                                               "norm.weight": torch.ones(64, dtype=torch.long)}),
                            M, "int64"),
    },
    "meta file not a dict of tensors": {
        "a list": (lambda d: meta(d, [torch.zeros(2)]), M, "list"),
        "an int": (lambda d: meta(d, 42), M, "int"),
        "a dict of ints": (lambda d: meta(d, {k: 1 for k in tiny().state_dict()}), M, "tensors"),
        "a dict with int keys": (lambda d: meta(d, {1: torch.zeros(2)}), M, "tensors"),
        "nested dicts": (lambda d: meta(d, {"model": tiny().state_dict()}), M, "tensors"),
    },
    "values that shape the model": {
        "params dim overflows": (lambda d: meta(d, params={"dim": 10 ** 30}), M, "'dim'"),
        "params vocab 2**40": (lambda d: meta(d, params={"vocab_size": 2 ** 40}), M,
                               "'vocab_size'"),
        "params max_seq_len 2**63": (lambda d: meta(d, params={"max_seq_len": 2 ** 63}), M,
                                     "'max_seq_len'"),
        "params n_layers 10**20": (lambda d: meta(d, params={"n_layers": 10 ** 20}), M,
                                   "'n_layers'"),
        "params norm_eps 1e300": (lambda d: meta(d, params={"norm_eps": 1e300}), M, "epsilon"),
        "params rope_theta 0.5": (lambda d: meta(d, params={"rope_theta": 0.5}), M, "rope base"),
        "params odd head size": (lambda d: meta(d, params={"dim": 60, "n_heads": 4,
                                                           "n_kv_heads": 2}), M, "odd"),
        "params stop token past vocab": (lambda d: meta(d, params={"stop_tokens": [512]}), M,
                                         "stop token"),
        "params ffn multiplier negative": (lambda d: meta(d, params={
            "ffn_dim_multiplier": -1.0}), M, "ffn_dim_multiplier"),
        "config eps 5.0": (lambda d: hf(d, config=set_("rms_norm_eps", 5.0)), M, "epsilon"),
        "config rope low == high": (lambda d: hf(d, config=lambda c: c["rope_scaling"].update(
            low_freq_factor=4.0)), M, "high_freq_factor"),
        "config rope factor 1e400": (lambda d: hf(d, config=lambda c: c["rope_scaling"].update(
            factor=float("inf"))), M, "factor"),
        "config eos past vocab": (lambda d: hf(d, config=set_("eos_token_id", [7, 9999])), M,
                                  "stop token"),
        "config max_position 2**40": (lambda d: hf(d, config=set_(
            "max_position_embeddings", 2 ** 40)), M, "max_position_embeddings"),
        "gguf negative epsilon": (lambda d: gguf_file(d, {
            "llama.attention.layer_norm_rms_epsilon": (-1e-5, V.FLOAT32)}), M, "epsilon"),
        "gguf zero rope base": (lambda d: gguf_file(d, {
            "llama.rope.freq_base": (0.0, V.FLOAT32)}), M, "freq_base"),
        "gguf context length 0": (lambda d: gguf_file(d, {
            "llama.context_length": (0, V.UINT32)}), M, "context_length"),
        "gguf eos past vocab": (lambda d: gguf_file(d, {
            "tokenizer.ggml.eos_token_id": (600, V.UINT32)}), M, "stop token"),
        "gguf linear factor 0": (lambda d: gguf_file(d, {
            "llama.rope.scaling.type": ("linear", V.STRING),
            "llama.rope.scaling.factor": (0.0, V.FLOAT32)}), M, "scaling.factor"),
    },
    "gguf metadata of the wrong kind or missing": {
        "epsilon a string": (lambda d: gguf_file(d, {
            "llama.attention.layer_norm_rms_epsilon": ("tiny", V.STRING)}), M, "epsilon"),
        "rope base a string": (lambda d: gguf_file(d, {
            "llama.rope.freq_base": ("10000", V.STRING)}), M, "freq_base"),
        "context length a float": (lambda d: gguf_file(d, {
            "llama.context_length": (256.5, V.FLOAT32)}), M, "context_length"),
        "width a string": (lambda d: gguf_file(d, {
            "llama.embedding_length": ("64", V.STRING)}), M, "embedding_length"),
        "layers a bool": (lambda d: gguf_file(d, {"llama.block_count": (True, V.BOOL)}), M,
                          "block_count"),
        "linear scaling without its factor": (lambda d: gguf_file(d, {
            "llama.rope.scaling.type": ("linear", V.STRING)}), M, "scaling.factor"),
        "linear scaling factor a string": (lambda d: gguf_file(d, {
            "llama.rope.scaling.type": ("linear", V.STRING),
            "llama.rope.scaling.factor": ("2", V.STRING)}), M, "scaling.factor"),
        "scaling type a number": (lambda d: gguf_file(d, {
            "llama.rope.scaling.type": (1, V.UINT32)}), M, "scaling.type"),
        "eos id a string": (lambda d: gguf_file(d, {
            "tokenizer.ggml.eos_token_id": ("2", V.STRING)}), M, "eos_token_id"),
        "rope dimension a string": (lambda d: gguf_file(d, {
            "llama.rope.dimension_count": ("16", V.STRING)}), M, "dimension_count"),
        "no feed-forward width": (lambda d: gguf_file(d, drop={"llama.feed_forward_length"}), M,
                                  "feed_forward_length"),
        "no vocabulary size and no embedding": (lambda d: gguf_file(d, drop={
            "llama.vocab_size"}, model=tiny()), None, None),
    },
    "gguf tokenizer metadata that lies": {
        "chatml template, no <|im_start|>": (lambda d: gguf_tok(
            d, tokenizer__ggml__token_type=[1] * 259 + [1, 3]), T, "<|im_start|>"),
        "llama3 template, no header tokens": (lambda d: gguf_tok(
            d, tokenizer__chat_template="{{'<|start_header_id|>'}}"), T, "<|start_header_id|>"),
        "tokens a string": (lambda d: gguf_tok(d, tokenizer__ggml__tokens="abc",
                                               tokenizer__ggml__token_type=None,
                                               tokenizer__ggml__merges=None,
                                               tokenizer__ggml__eos_token_id=None), T,
                            "tokenizer.ggml.tokens"),
        "types shorter than tokens": (lambda d: gguf_tok(
            d, tokenizer__ggml__token_type=[1] * 200), T, "token_type"),
        "merges numbers": (lambda d: gguf_tok(d, tokenizer__ggml__merges=[1, 2, 3]), T,
                           "merges"),
        "eos id past the vocabulary": (lambda d: gguf_tok(
            d, tokenizer__ggml__eos_token_id=9999), T, "eos_token_id"),
        "bos id past the vocabulary": (lambda d: gguf_tok(
            d, tokenizer__ggml__bos_token_id=262), T, "bos_token_id"),
        "a token spelled twice": (lambda d: gguf_tok(
            d, tokenizer__ggml__tokens=TOKENS[:258] + ["he"] + TOKENS[259:],
            tokenizer__ggml__merges=None), T, "twice"),
        "pre-tokenizer a number": (lambda d: gguf_tok(d, tokenizer__ggml__pre=7), T,
                                   "pre-tokenizer"),
    },
    "damaged gguf cache": {
        "metadata.json garbage": (lambda d: cached(d, lambda f: (f / "metadata.json")
                                                   .write_text("{oops")), M, None),
        "metadata.json a list": (lambda d: cached(d, lambda f: (f / "metadata.json")
                                                  .write_text("[]")), M, None),
        "metadata.json without tensors": (lambda d: cached(d, lambda f: (f / "metadata.json")
                                                           .write_text('{"a": 1}')), M, None),
        "metadata.json lying about the width": (lambda d: cached(d, lambda f: (
            f / "metadata.json").write_text(json.dumps({
                **json.loads((f / "metadata.json").read_text()),
                "llama.embedding_length": "wide"}))), M, None),
        "weights truncated": (lambda d: cached(d, lambda f: (f / "weights-float32.safetensors")
                                               .write_bytes(b"\x08\0\0\0\0\0\0\0{}")), M, None),
        "weights missing a tensor": (lambda d: cached(d, lambda f: save_file(
            {k: v for k, v in load_file(f / "weights-float32.safetensors").items()
             if k != "norm.weight"}, f / "weights-float32.safetensors")), M, None),
        "weights of another shape": (lambda d: cached(d, lambda f: save_file(
            {**load_file(f / "weights-float32.safetensors"), "norm.weight": torch.ones(3)},
            f / "weights-float32.safetensors")), M, None),
        "weights of int dtype": (lambda d: cached(d, lambda f: save_file(
            {**load_file(f / "weights-float32.safetensors"),
             "norm.weight": torch.ones(64, dtype=torch.int32)},
            f / "weights-float32.safetensors")), M, None),
        "a folder inside the cache, source.json gone": (lambda d: cached(d, lambda f: (
            (f / "source.json").unlink(), (f / "junk").mkdir(), (f / "junk" / "x").touch())),
            M, None),
    },
    "not a regular file": {
        "a FIFO named .gguf (model)": (fifo, M, "not a regular file"),
        "a FIFO named .gguf (tokenizer)": (fifo, T, "not a regular file"),
        "/dev/zero named .gguf (model)": (lambda d: link(d, "/dev/zero"), M, "not a regular"),
        "/dev/zero named .gguf (tokenizer)": (lambda d: link(d, "/dev/zero"), T,
                                              "not a regular"),
        "a socket named .gguf": (sock, M, "not a regular file"),
        "a folder holding a FIFO .gguf": (lambda d: in_folder(d, fifo), M, "not a regular"),
        "a dangling link .gguf": (lambda d: link(d, d / "nowhere"), M, "no such"),
    },
}


def names(cls):
    return list(PROBES[cls])


def run(probe, d):
    build, call, words = probe
    path = build(d)
    return path, call, words


@pytest.mark.parametrize("cls, name", [(c, n) for c in PROBES for n in PROBES[c]])
def test_a_lying_checkpoint_is_one_named_error(tmp_path, cls, name):
    path, call, words = run(PROBES[cls][name], tmp_path)
    if cls == "damaged gguf cache":
        # A damaged cache is the cache's fault, not the file's: recognised, rebuilt, and the
        # model loads with the GGUF file's own weights.
        model = load_model(path)
        reference = tiny()
        assert all(torch.equal(model.state_dict()[k], v) for k, v in
                   reference.state_dict().items()), "the damaged cache was used"
        assert load_model(path).args.dim == 64                      # and then it is whole again
        return
    if call is None:            # a file the format allows: vocab size from the embedding
        assert load_model(path).args.vocab_size == 512
        return
    with pytest.raises(NAMED) as e:
        call(path)
    message = str(e.value)
    assert "\n" not in message and words.lower() in message.lower(), message


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path):
    """The embedded tokenizer (4,352 ids) beside a model of 512: the chat's pair check."""
    from minipaged.formats import check_pair
    model = tiny()
    with pytest.raises(TokenizerError, match="does not belong to the model"):
        check_pair(model, load_tokenizer())
    check_pair(load_model(), load_tokenizer())                         # the real pair


def test_the_chat_refuses_a_tokenizer_larger_than_its_model(tmp_path):
    from cli_probes import refused, run_many
    folder = save_model(tiny(), tmp_path / "m")
    (folder / "tokenizer.model").write_bytes((DEFAULT_MODEL_DIR / "tokenizer.model").read_bytes())
    result, = run_many("minipaged.chat", [(["--model", folder, "--prompt", "hi"], None)])
    refused(result, "does not belong to the model")


def test_the_chat_answers_a_lying_checkpoint_with_one_error_line(tmp_path):
    from cli_probes import refused, run_many
    picks = [("tensors not floating point", "int32 embedding"),
             ("values that shape the model", "gguf negative epsilon"),
             ("meta file not a dict of tensors", "a list"),
             ("not a regular file", "a FIFO named .gguf (model)"),
             ("hf tensors vs config", "q rows not heads x head_dim")]
    probes, words = [], []
    for i, (cls, name) in enumerate(picks):
        d = tmp_path / str(i)
        d.mkdir()
        path, _, expected = run(PROBES[cls][name], d)
        probes.append((["--model", path, "--prompt", "hi"], None))
        words.append(expected)
    for result, expected in zip(run_many("minipaged.chat", probes,
                                         XDG_CACHE_HOME=str(tmp_path / "cache")), words):
        refused(result, expected)
