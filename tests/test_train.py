"""`python -m minipaged.embedded.train` makes the shipped model: the same seed gives the same files, the
tokenizer it trains is the shipped one byte for byte, and what it writes loads through the
same `load_model` / `load_tokenizer` as a real Llama 3.

The full 450-step run takes about 20 minutes on an idle 2-core machine, too long for CI; these
tests run the same code for a few small steps."""

import json

import pytest
import torch
from safetensors.torch import load_file

from minipaged import generate, load_model, load_tokenizer
from minipaged.formats import DEFAULT_MODEL_DIR
from minipaged.embedded.train import train


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    threads = torch.get_num_threads()
    runs = []
    try:
        for name in ("first", "second"):
            out = tmp_path_factory.mktemp(name)
            train(out, steps=3, batch_size=2, seq_len=32, seed=0, threads=1,
                  plot_path=out / "loss.png")
            runs.append(out)
    finally:
        torch.set_num_threads(threads)
    return runs


def test_the_tokenizer_it_trains_is_the_shipped_one(two_runs):
    assert (two_runs[0] / "tokenizer.model").read_bytes() == \
        (DEFAULT_MODEL_DIR / "tokenizer.model").read_bytes()


def test_the_same_seed_gives_the_same_weights(two_runs):
    a = load_file(two_runs[0] / "model.safetensors")
    b = load_file(two_runs[1] / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_what_it_writes_loads_like_a_real_checkpoint(two_runs):
    out = two_runs[0]
    model, tok = load_model(out), load_tokenizer(out)
    shipped = load_model()
    assert model.args.dim == shipped.args.dim and model.args.n_layers == shipped.args.n_layers
    assert model.args.n_kv_heads < model.args.n_heads and model.args.use_scaled_rope
    assert model.args.vocab_size == tok.n_words
    out_tokens = generate(model, [tok.encode("what is a block?", bos=True)], 4)
    assert len(out_tokens[0]) <= 4


def test_the_report_and_the_loss_curve(two_runs):
    out = two_runs[0]
    report = json.loads((out / "training.json").read_text())
    assert report["steps"] == 3 and report["seed"] == 0
    # three steps from a random init: still near log(vocab), and the baseline is unchanged
    assert report["heldout_loss"] > report["unigram_heldout_loss"] - 1
    shipped = json.loads((DEFAULT_MODEL_DIR / "training.json").read_text())
    assert report["unigram_heldout_loss"] == pytest.approx(shipped["unigram_heldout_loss"])
    assert (out / "loss.png").stat().st_size > 10_000
