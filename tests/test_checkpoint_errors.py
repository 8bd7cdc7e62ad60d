"""Bad checkpoints get one named error whose message says what was expected and what was found."""

import json

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from minipaged import CheckpointError, load_model, save_model
from minipaged.formats import loading


@pytest.fixture
def hf_dir(tmp_path):
    return save_model(tiny_model(dtype=torch.float32), tmp_path / "hf")


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or folder"):
        load_model(tmp_path / "nope")


def test_a_file_instead_of_a_folder(hf_dir):
    with pytest.raises(CheckpointError, match="is a file; give the folder"):
        load_model(hf_dir / "config.json")


def test_folder_with_neither_layout(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match=r"expected params.json \+ consolidated.00.pth .*found notes.txt"):
        load_model(tmp_path)


def test_missing_tensor(hf_dir):
    st = load_file(hf_dir / "model.safetensors")
    del st["model.layers.1.mlp.up_proj.weight"]
    save_file(st, hf_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing 1 tensors .*layers.1.feed_forward.w3.weight"):
        load_model(hf_dir)


def test_wrong_shape(hf_dir):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["intermediate_size"] += 32
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"has shape \(\d+, 64\), but config.json implies"):
        load_model(hf_dir)


def test_unexpected_tensor(hf_dir):
    st = load_file(hf_dir / "model.safetensors")
    st["model.layers.0.self_attn.q_norm.weight"] = torch.ones(64)
    save_file(st, hf_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.self_attn.q_norm.weight'"):
        load_model(hf_dir)


def test_corrupt_safetensors_and_json(hf_dir):
    (hf_dir / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="as safetensors"):
        load_model(hf_dir)
    (hf_dir / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="could not read .*config.json"):
        load_model(hf_dir)


def test_meta_checkpoint_refuses_pickled_objects(tmp_path):
    meta = save_model(tiny_model(dtype=torch.float32), tmp_path, layout="meta")
    torch.save({"evil": object()}, meta / "consolidated.00.pth")   # not plain tensors
    with pytest.raises(CheckpointError, match="could not read .*consolidated.00.pth"):
        load_model(meta)


def test_sharded_hf_checkpoint_and_missing_shard(hf_dir):
    st = load_file(hf_dir / "model.safetensors")
    (hf_dir / "model.safetensors").unlink()
    names = sorted(st)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: st[k] for k in keys}, hf_dir / file)
    index = {"weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    assert load_model(hf_dir).args.n_layers == 2
    (hf_dir / "model-00002-of-00002.safetensors").rename(hf_dir / "elsewhere.bin")
    with pytest.raises(CheckpointError, match="missing the shard model-00002-of-00002"):
        load_model(hf_dir)


def edit_json(path, change):
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


def without(key):
    return lambda cfg: {k: v for k, v in cfg.items() if k != key}


def with_(key, value):
    return lambda cfg: {**cfg, key: value}


@pytest.mark.parametrize("change, names", [
    (lambda cfg: [cfg], "holds a JSON list"),
    (lambda cfg: 42, "holds a JSON int"),
    (without("hidden_size"), "lacks 'hidden_size'"),
    (without("num_hidden_layers"), "lacks 'num_hidden_layers'"),
    (without("num_attention_heads"), "lacks 'num_attention_heads'"),
    (without("vocab_size"), "lacks 'vocab_size'"),
    (without("intermediate_size"), "lacks 'intermediate_size'"),
    (with_("hidden_size", "64"), "'hidden_size' must be a whole number"),
    (with_("num_hidden_layers", 2.5), "'num_hidden_layers' must be a whole number"),
    (with_("num_attention_heads", 0), "'num_attention_heads' must be a whole number"),
    (with_("num_key_value_heads", True), "'num_key_value_heads' must be a whole number"),
    (with_("num_attention_heads", 7), "heads must split evenly"),
    (with_("rms_norm_eps", None), "'rms_norm_eps' must be a positive number"),
    (with_("rope_theta", "big"), "'rope_theta' must be a positive number"),
    (with_("max_position_embeddings", -1), "'max_position_embeddings' must be a whole number"),
    (with_("tie_word_embeddings", "no"), "'tie_word_embeddings' must be true or false"),
    (with_("rope_scaling", [1, 2]), "'rope_scaling' must be an object"),
    (lambda cfg: {**cfg, "rope_scaling": {**cfg["rope_scaling"], "factor": "8"}},
     r"\(rope_scaling\): 'factor' must be a positive number"),
    (lambda cfg: {**cfg, "rope_scaling": without("factor")(cfg["rope_scaling"])},
     r"\(rope_scaling\) lacks 'factor'"),
    (with_("eos_token_id", "eot"), "'eos_token_id' must be a token id"),
    (with_("head_dim", "16"), "'head_dim' must be a whole number"),
    # 2**62 numbers in one matrix: torch's size in bytes would overflow
    (lambda cfg: {**without("head_dim")(cfg), "hidden_size": 2**31 - 8,
                  "intermediate_size": 2**31 - 1},
     "a weight matrix of 2,147,483,647 x 2,147,483,640 numbers is larger than any machine"),
])
def test_malformed_config_names_the_file_and_the_key(hf_dir, change, names):
    edit_json(hf_dir / "config.json", change)
    with pytest.raises(CheckpointError, match=names) as e:
        load_model(hf_dir)
    assert str(hf_dir / "config.json") in str(e.value)


@pytest.mark.parametrize("change, names", [
    (lambda p: "params", "holds a JSON str"),
    (without("dim"), "lacks 'dim'"),
    (without("n_layers"), "lacks 'n_layers'"),
    (without("vocab_size"), "lacks 'vocab_size'"),
    (with_("n_layers", "2"), "'n_layers' must be a whole number"),
    (with_("norm_eps", [1e-5]), "'norm_eps' must be a positive number"),
    (with_("use_scaled_rope", 1), "'use_scaled_rope' must be true or false"),
    (with_("stop_tokens", ["eot"]), "'stop_tokens' must be a token id"),
    # sizes whose products overflow: refused before any width is computed or tensor shaped
    (with_("dim", 10**9), "feed-forward width .* is past 2\\*\\*31"),
    (with_("ffn_dim_multiplier", 1e308), "feed-forward width .* is past 2\\*\\*31"),
])
def test_malformed_params_name_the_file_and_the_key(tmp_path, change, names):
    meta = save_model(tiny_model(dtype=torch.float32), tmp_path, layout="meta")
    edit_json(meta / "params.json", change)
    with pytest.raises(CheckpointError, match=names) as e:
        load_model(meta)
    assert str(meta / "params.json") in str(e.value)


def test_config_that_is_not_utf8_and_an_index_without_its_map(hf_dir):
    (hf_dir / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="index.json: 'weight_map' must be an object"):
        load_model(hf_dir)
    (hf_dir / "config.json").write_bytes(b'{"hidden_size": "\xff"}')
    with pytest.raises(CheckpointError, match="could not read .*config.json"):
        load_model(hf_dir)


def test_optional_keys_take_the_defaults_transformers_gives_them(hf_dir):
    """A key that does not shape the model may be absent; it then means what it means to the
    format's own reader, transformers' LlamaConfig (an independent reference)."""
    reference = LlamaConfig()
    for key in ("rms_norm_eps", "max_position_embeddings", "tie_word_embeddings"):
        edit_json(hf_dir / "config.json", without(key))
    args = load_model(hf_dir).args
    assert args.norm_eps == reference.rms_norm_eps
    assert args.max_seq_len == reference.max_position_embeddings
    assert args.tie_word_embeddings == reference.tie_word_embeddings
    # A default that would change a shape cannot slip through: the tensors disagree with it.
    edit_json(hf_dir / "config.json", without("num_key_value_heads"))
    with pytest.raises(CheckpointError, match="has shape .* but config.json implies"):
        load_model(hf_dir)


def test_a_config_with_more_layers_than_its_tensors_is_refused_before_they_are_built(
        tmp_path, monkeypatch):
    """100,000,000 layers would be built (shapes only, but each a Python object) before the
    tensors were compared: a MemoryError after minutes. The count is checked first, before any
    model is built (building one here fails the test instead of filling the memory)."""
    meta = save_model(tiny_model(dtype=torch.float32), tmp_path, layout="meta")
    monkeypatch.setattr(loading, "Llama", lambda args: pytest.fail(f"built {args.n_layers} layers"))
    for n_layers in (10**8, 3, 1):
        edit_json(meta / "params.json", with_("n_layers", n_layers))
        with pytest.raises(CheckpointError, match=f"says the model has {n_layers:,} layers, but "
                                                  f"its tensors are those of 2"):
            load_model(meta)
