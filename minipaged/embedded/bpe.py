"""Byte-level BPE training: how a tiktoken `tokenizer.model` like Llama 3's is made.

Ranks 0..255 are the single bytes; every merge of the two most frequent adjacent tokens adds the
next rank. Text is first cut into chunks by the split pattern and the chunks are counted, so the
trainer works on each distinct chunk once, weighted by its count: a few MB of text become tens of
thousands of distinct chunks, and only the chunks holding the merged pair are touched per merge.

tiktoken keeps no merge list: it encodes by rank of the *concatenated bytes* (again and again,
merge the adjacent pair whose bytes spell the lowest-ranked token). For ranks trained here that
gives the very tokens the merge list gives, on any text: merges run left to right, so a span whose
ends stay token boundaries is split the same way wherever it occurs, and two tokens spelling a
known token were merged when that token was made. tests/test_bpe.py checks it with a plain loop.

    python -m minipaged.embedded.bpe corpus.txt --vocab-size 4000 --out tokenizer.model
"""

import base64
import heapq
import time
from collections import Counter, defaultdict
from pathlib import Path

import regex

from .. import cli
from ..errors import UsageError
from ..formats.atomic import write_file
from ..formats.tokenizer import LLAMA3_PATTERN


def count_chunks(texts, pattern=LLAMA3_PATTERN):
    """Split every text with `pattern`; return {chunk as UTF-8 bytes: how often it occurs}."""
    split = regex.compile(pattern)
    counts = Counter()
    for text in texts:
        counts.update(split.findall(text))
    return {chunk.encode("utf-8"): n for chunk, n in counts.items()}


def _merge(word, pair, new_id):
    """Replace every occurrence of `pair` in `word`, left to right (as tiktoken would)."""
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == pair[0] and word[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def learn_merges(chunk_counts, num_merges, progress=None):
    """Learn up to `num_merges` merges [(left id, right id), ...]; merge i creates id 256 + i.

    Most frequent pair first; ties go to the smallest (left, right) ids, so the result does not
    depend on the order of the input. Stops early when no pair is left to merge.
    """
    words = [list(chunk) for chunk in chunk_counts]  # each chunk as its current token ids
    freqs = list(chunk_counts.values())
    pair_counts = Counter()
    where = defaultdict(set)  # pair -> indices of words that hold (or once held) it
    for w, word in enumerate(words):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += freqs[w]
            where[pair].add(w)
    # A max-heap of (count, pair). A count change pushes a fresh entry; stale ones are skipped.
    heap = [(-n, pair) for pair, n in pair_counts.items()]
    heapq.heapify(heap)
    merges = []
    while heap and len(merges) < num_merges:
        neg_count, pair = heapq.heappop(heap)
        if neg_count == 0 or pair_counts[pair] != -neg_count:
            continue
        new_id = 256 + len(merges)
        changed = Counter()  # pair -> change of its count
        for w in where.pop(pair):
            old_word, new_word = words[w], _merge(words[w], pair, new_id)
            for p in zip(old_word, old_word[1:]):
                changed[p] -= freqs[w]
            for p in zip(new_word, new_word[1:]):
                changed[p] += freqs[w]
                where[p].add(w)
            words[w] = new_word
        for p, delta in changed.items():
            if delta:
                pair_counts[p] += delta
                heapq.heappush(heap, (-pair_counts[p], p))
        merges.append(pair)
        if progress is not None:
            progress(len(merges), num_merges)
    return merges


def ranks_from_merges(merges):
    """{token bytes: rank}: the 256 single bytes, then one token per merge, in merge order."""
    vocab = [bytes([b]) for b in range(256)]
    for left, right in merges:
        vocab.append(vocab[left] + vocab[right])
    return {tok: i for i, tok in enumerate(vocab)}


def train_bpe(texts, vocab_size, pattern=LLAMA3_PATTERN, progress=None):
    """Train a byte-level BPE of `vocab_size` ranks (fewer if the text runs out of pairs).

    Returns {token bytes: rank}, ready for `save_tiktoken_bpe`; the 256 special tokens are not
    part of it (the Tokenizer appends them after the last rank, as Llama 3 does).
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 256:
        raise UsageError(f"vocab_size must be at least 256 (one token per byte), got "
                         f"{vocab_size!r}")
    merges = learn_merges(count_chunks(texts, pattern), vocab_size - 256, progress)
    return ranks_from_merges(merges)


def save_tiktoken_bpe(ranks, path):
    """Write `base64(token) rank` lines in rank order: the format of Llama 3's tokenizer.model."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [base64.b64encode(tok) + b" %d\n" % rank
             for tok, rank in sorted(ranks.items(), key=lambda item: item[1])]
    path.write_bytes(b"".join(lines))


def read_text(path: Path) -> str:
    """A training file's text, or a UsageError saying why it cannot be read: a device or a
    FIFO (/dev/zero never ends) is refused before a byte is read."""
    if path.exists() and not path.is_dir() and not path.is_file():
        raise UsageError(f"{path} is not a regular file (a device or a FIFO, which may never "
                         f"end); train on text files")
    try:
        return path.read_text(encoding="utf-8")
    except MemoryError:
        raise UsageError(f"{path} is too large to read into this machine's memory; train on "
                         f"a smaller sample of it") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{path} is not UTF-8 text (byte {e.start:,} is not UTF-8); train "
                         f"on text files") from None
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None


@cli.program
def main(argv=None):
    parser = cli.ArgumentParser(prog="python -m minipaged.embedded.bpe",
                                description="Train a byte-level BPE tokenizer.model.")
    parser.add_argument("files", nargs="+", type=Path, help="UTF-8 text files to train on")
    parser.add_argument("--vocab-size", type=int, default=4000)
    parser.add_argument("--out", type=cli.output_file, default=Path("tokenizer.model"))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    texts = [read_text(f) for f in args.files]
    ranks = train_bpe(texts, args.vocab_size)
    write_file(args.out, lambda p: save_tiktoken_bpe(ranks, p))
    print(f"{len(ranks)} ranks from {sum(len(t.encode()) for t in texts):,} bytes "
          f"in {time.perf_counter() - start:.1f} s -> {args.out}")


if __name__ == "__main__":
    raise SystemExit(main())
