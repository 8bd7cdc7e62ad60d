"""minipaged: PagedAttention, the KV-cache paging at the heart of vLLM, built up step by step."""

from .errors import (CheckpointError, MiniPagedError, OutOfBlocksError, RequestError,
                     TokenizerError)
from .model import Llama, ModelArgs
from .checkpoint import load_model, save_model
from .generate import generate
from .tokenizer import ChatFormat, Tokenizer, load_tokenizer
