"""Meta's own Llama 3 reference model (from the `llama-models` package) runnable on a CPU.

Meta's model.py builds its layers from fairscale's model-parallel classes. With one process
those are plain Linear/Embedding layers, so small stand-ins with the same parameter names let
the reference run here unchanged. Used only by the tests, as an independent ground truth.
"""

import sys
import types

import torch.nn as nn


def _install_fairscale_standins():
    if "fairscale.nn.model_parallel.layers" in sys.modules:
        return

    class _Linear(nn.Linear):
        def __init__(self, in_features, out_features, bias=True, **_):
            super().__init__(in_features, out_features, bias=bias)

    class _Embedding(nn.Embedding):
        def __init__(self, num_embeddings, embedding_dim, **_):
            super().__init__(num_embeddings, embedding_dim)

    layers = types.ModuleType("fairscale.nn.model_parallel.layers")
    layers.ColumnParallelLinear = layers.RowParallelLinear = _Linear
    layers.VocabParallelEmbedding = _Embedding
    init = types.ModuleType("fairscale.nn.model_parallel.initialize")
    init.get_model_parallel_world_size = lambda: 1
    names = ["fairscale", "fairscale.nn", "fairscale.nn.model_parallel"]
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    sys.modules["fairscale.nn.model_parallel.layers"] = layers
    sys.modules["fairscale.nn.model_parallel.initialize"] = init
    sys.modules["fairscale.nn.model_parallel"].initialize = init
    sys.modules["fairscale.nn.model_parallel"].layers = layers


def meta_transformer(params: dict, state_dict, max_batch_size=4, max_seq_len=256):
    """Meta's `Transformer` with our params.json values and weights loaded."""
    _install_fairscale_standins()
    from llama_models.llama3.args import ModelArgs
    from llama_models.llama3.model import Transformer

    args = ModelArgs(**params, max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    model = Transformer(args)
    model.load_state_dict(state_dict, strict=True)
    return model.eval()
