"""Shared fixtures: tiny random Llama 3 models (the embedded model is not needed for these),
and a fake model with no weights whose cache holds token ids."""

import os

import pytest
import torch

# Without a CUDA GPU, Triton kernels run in Triton's interpreter, which must be switched on
# before triton is imported (importing minipaged imports it, for backend="triton").
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minipaged import Llama, ModelArgs, generate  # noqa: E402  (after the switch above)
from minipaged.generation import generate_static  # noqa: E402
from minipaged.kv_cache import ContiguousCache  # noqa: E402
from minipaged.paged_generation import generate_paged  # noqa: E402

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


def check_paged_generation(backend, n, dtype=torch.float32, device="cpu"):
    """A tiny model's greedy tokens on a paged cache attending through `backend`, in stage 3's
    static batch (blocks of 16) and through the Engine (blocks of 4), are the contiguous
    cache's. Of the prompts of 3, 14 and 17 tokens, the 14 crosses into a second block."""
    model = tiny_model(dtype=dtype).to(device)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (k,), generator=gen).tolist() for k in (3, 14, 17)]
    cache = ContiguousCache(model.args, len(prompts), 64, device=device, dtype=dtype)
    expected = generate_static(model, prompts, n, cache=cache, stop_tokens=[])
    assert generate_paged(model, prompts, n, block_size=16, backend=backend,
                          stop_tokens=[]) == expected                       # stage 3's batch
    assert generate(model, prompts, n, cache="paged", block_size=4, backend=backend,
                    stop_tokens=[]) == expected                             # the Engine


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


class FakeModel(torch.nn.Module):
    """Stands in for Llama: same call, same cache traffic, random next tokens. It writes each
    token's id into the cache as its key (and the id minus the layer as its value), so a test
    can read a pool back and compare it with the tokens a sequence should hold; `calls` counts
    the tokens of every call."""

    def __init__(self, seed: int, vocab: int = 6, n_layers: int = 2, max_seq_len: int = 64):
        super().__init__()
        self.args = ModelArgs(dim=2, n_layers=n_layers, n_heads=1, n_kv_heads=1,
                              vocab_size=vocab, multiple_of=1, max_seq_len=max_seq_len)
        self.anchor = torch.nn.Parameter(torch.zeros(1))      # the engine reads device, dtype
        self.rng = torch.Generator().manual_seed(seed)
        self.calls = []                                       # tokens of every call, B * T

    def forward(self, tokens, cache=None, last_only=False, logits_indices=None):
        B, T = tokens.shape
        self.calls.append(B * T)
        ids = tokens.float()[:, :, None, None].expand(B, T, 1, 2)        # (B, T, Hk=1, D=2)
        for layer in range(self.args.n_layers):
            cache.attend(layer, torch.zeros_like(ids), ids.clone(), ids - layer)
        rows = 1 if last_only else T if logits_indices is None else len(logits_indices)
        return torch.randn(B, rows, self.args.vocab_size, generator=self.rng)
