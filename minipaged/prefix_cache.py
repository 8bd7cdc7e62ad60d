"""Stage 6: prefix caching — find full blocks of a prompt seen before by a chained hash.

A full block is named by the hash of its tokens *and* the hash of the block before it:

    h_0 = H(ROOT, tokens[0:bs]),  h_1 = H(h_0, tokens[bs:2bs]),  ...

so two blocks with the same tokens at different positions (or after different prefixes) get
different names, and finding h_j means the whole prompt up to block j matches (vLLM v1 and
nano-vllm chain their block hashes the same way). Only full blocks are named: a partial block
can still change.

`PrefixCache` is one layer's bookkeeping: which physical block holds which hash, and the
cached-free queue — blocks whose last owner has ended but whose K/V and hash are kept for a
later request. When the pool needs memory, the least recently freed of them is evicted first.
The CacheManager owns one and calls it; nothing here touches K/V tensors.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

ROOT = b"minipaged-prefix-root"     # the "parent hash" of a prompt's first block


def block_hash(parent: bytes | None, tokens) -> bytes:
    """The name of one full block: blake2b over its parent's name and its token ids."""
    data = np.asarray(list(tokens), dtype=np.int64).tobytes()
    return hashlib.blake2b((parent or ROOT) + data, digest_size=16).digest()


def block_hashes(tokens, block_size: int, parent: bytes | None = None, start: int = 0) -> list:
    """The chained hashes of every full block of `tokens`, from logical block `start` on
    (`parent` is then block start-1's hash). A partial last block gets none."""
    out = []
    for j in range(start, len(tokens) // block_size):
        parent = block_hash(parent, tokens[j * block_size:(j + 1) * block_size])
        out.append(parent)
    return out


class PrefixCache:
    """hash <-> physical block, plus the cached-free blocks in least-recently-freed order."""

    def __init__(self):
        self.block_of: dict[bytes, int] = {}         # hash -> the block that holds it
        self.hash_of: dict[int, bytes] = {}          # block -> its hash (full, named blocks only)
        self.cached_free: OrderedDict[int, None] = OrderedDict()   # oldest-freed first
        self.hits = 0                                # cached-free blocks brought back by a hit

    def __len__(self) -> int:
        """Cached-free blocks: free to take, but still holding a named block's K/V."""
        return len(self.cached_free)

    def match(self, hashes) -> list[int]:
        """The blocks holding the longest run of leading `hashes` (the chain: stop at a miss)."""
        blocks = []
        for h in hashes:
            b = self.block_of.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def name(self, block: int, h: bytes) -> None:
        """A block just became full with these tokens. If another block already holds the same
        hash, keep that one (its twin stays unnamed and is freed normally)."""
        if h not in self.block_of and block not in self.hash_of:
            self.block_of[h], self.hash_of[block] = block, h

    def release(self, block: int) -> bool:
        """A block's count reached zero. A named block joins the cached-free queue (True);
        an unnamed one is really free (False)."""
        if block in self.hash_of:
            self.cached_free[block] = None           # newest at the end
            return True
        return False

    def revive(self, block: int) -> None:
        """A cached-free block is owned again (a prefix hit): take it out of the queue."""
        del self.cached_free[block]
        self.hits += 1

    def evict(self, k: int) -> list[int]:
        """Take the k least recently freed cached blocks, forgetting their hashes."""
        out = []
        for _ in range(k):
            block, _ = self.cached_free.popitem(last=False)
            del self.block_of[self.hash_of.pop(block)]
            out.append(block)
        return out
