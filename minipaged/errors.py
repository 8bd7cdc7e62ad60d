"""The errors a user of minipaged can run into.

Each one carries a sentence that says what went wrong and what to do about it, so the
command-line tools can print the message instead of a traceback.
"""


class MiniPagedError(Exception):
    """Base class: something the user can fix (a path, an argument, a budget)."""


class CheckpointError(MiniPagedError):
    """A model checkpoint is missing, incomplete, or not in a format minipaged reads."""


class TokenizerError(MiniPagedError):
    """A tokenizer file is missing or not in tiktoken's `base64(token) rank` format."""


class RequestError(MiniPagedError):
    """A generation request that cannot be served as asked (empty prompt, too long, bad id...)."""


class OutOfBlocksError(MiniPagedError):
    """The KV cache has no room left; nothing was allocated by the failing call."""


class NotEnoughMemoryError(MiniPagedError):
    """A cache asked for more memory than the machine has available; nothing was allocated."""


class UsageError(MiniPagedError, ValueError):
    """An argument out of range or of the wrong kind: a command-line flag, or a parameter."""


class TraceError(MiniPagedError):
    """A request trace file (prompt and output lengths) is missing or not in a readable form."""


class OutputError(MiniPagedError, OSError):
    """A file or folder could not be written (a full disk, a read-only folder); what was there
    before is left as it was and nothing half-written remains."""


class PeerError(MiniPagedError):
    """An engine a benchmark compares against (vLLM, llama.cpp) could not start or answer."""


class TensorParallelError(MiniPagedError):
    """A rank of a tensor-parallel run (stage 9) failed, died or went silent; every other rank
    was stopped. The message names the rank."""
