"""Bad checkpoints get one named error whose message says what was expected and what was found."""

import json

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file, save_file

from minipaged import CheckpointError, load_model, save_model


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
