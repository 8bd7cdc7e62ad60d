"""Checkpoint and tokenizer formats: Meta's, Hugging Face's and llama.cpp's GGUF, one loader.

Not a stage of the course: every stage runs the same `Llama` whichever file it came from.
"""

from .checkpoint import save_model
from .gguf_checkpoint import PACKAGED_MODELS, packaged_model_path
from .loading import DEFAULT_MODEL_DIR, check_pair, load_model, load_tokenizer
from .tokenizer import ChatFormat, Tokenizer, chat_format
