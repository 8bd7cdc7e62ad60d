"""Shared fixtures: tiny random Llama 3 models (the embedded model is not needed for these)."""

import os

import pytest
import torch

# Without a CUDA GPU, Triton kernels run in Triton's interpreter, which must be switched on
# before triton is imported (importing minipaged imports it, for backend="triton").
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minipaged import Llama, ModelArgs  # noqa: E402  (after the switch above)

# The models here are tiny: a second thread gains nothing, and on a busy 2-core machine two
# threads that wait for each other at every operation made these tests 20x slower.
torch.set_num_threads(1)


def tiny_args(**overrides):
    cfg = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=32,
               max_seq_len=256, use_scaled_rope=True, rope_scale_factor=8.0)
    cfg.update(overrides)
    return ModelArgs(**cfg)


def tiny_model(seed=0, dtype=torch.float64, **overrides):
    """A random tiny Llama 3 (GQA, scaled rope). float64 keeps argmax ties out of exactness tests."""
    torch.manual_seed(seed)
    model = Llama(tiny_args(**overrides)).to(dtype).eval()
    # Random init is too gentle to make tokens differ much; widen the output distribution.
    with torch.no_grad():
        model.output.weight.mul_(8.0)
    return model


@pytest.fixture
def model():
    return tiny_model()


def greedy_reference(model, prompt, n):
    """Ground truth: recompute the whole sequence with the no-cache forward for every token."""
    seq, new = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            t = int(model(torch.tensor([seq]))[0, -1].argmax())
            new.append(t)
            seq.append(t)
    return new
