"""Plausible wrong solutions a learner could write, each planted in a task's reference (the
test that uses them: tests/test_grader_rejects.py). Each entry: task id, the wrong function's
source (compiled in the reference's own module, as a workspace file's would run), and words
the grader's sentence must contain."""

BUGS = {
    "reserve takes before checking the row": ("2.reserve", """
def reserve(self, seq_id, num_tokens):
    s, n = check_new(self, seq_id), check_count(num_tokens)
    k = self.blocks_for(n)
    blocks = self._take(k)                      # taken first: a refusal below leaks them
    check_room(self, [s], [k], k)
    self._table[s, :k] = blocks
    self._held[s], self._lens[s] = k, n
    self._live.add(s)
    return blocks
""", "changed the manager first"),
    "grow takes before checking the row": ("2.grow", """
def grow(self, seq_ids, num_new_tokens):
    rows, n = check_live(self, seq_ids, unique=True), check_count(num_new_tokens)
    seqs, held, needed = self._crossing(rows, n)
    total = sum(needed) - sum(held)
    if seqs:
        blocks = self._take(total)
        check_room(self, seqs, needed, 0)
        it = iter(blocks)
        for s, h, e in zip(seqs, held, needed):
            for j in range(h, e):
                self._table[s, j] = next(it)
            self._held[s] = e
    self._lens[rows] += n
    return total
""", "changed the manager first"),
    "grow skips the check that the sequences are live": ("2.grow", """
def grow(self, seq_ids, num_new_tokens):
    import numpy as np
    rows, n = np.asarray(list(seq_ids), dtype=np.int64), check_count(num_new_tokens)
    seqs, held, needed = self._crossing(rows, n)
    total = sum(needed) - sum(held)
    if seqs:
        check_room(self, seqs, needed, total)
        self._add_blocks(seqs, held, needed)
    self._lens[rows] += n
    return total
""", "not live"),
    "reserve skips the check that the sequence is new": ("2.reserve", """
def reserve(self, seq_id, num_tokens):
    s, n = int(seq_id), check_count(num_tokens)
    k = self.blocks_for(n)
    check_room(self, [s], [k], k)
    blocks = self._take(k)
    self._table[s, :k] = blocks
    self._held[s], self._lens[s] = k, n
    self._live.add(s)
    return blocks
""", "is live"),
    "free skips the check that the sequence is live": ("2.free", """
def free(self, seq_id):
    s = int(seq_id)
    blocks = self._table[s, : self._held[s]].tolist()
    self._release(blocks)
    self._table[s, : self._held[s]] = PAD_BLOCK
    self._held[s], self._lens[s] = 0, 0
    self._live.discard(s)
    return blocks
""", "not live"),
    "reserve passes the room check a wrong count": ("2.reserve", """
def reserve(self, seq_id, num_tokens):
    s, n = check_new(self, seq_id), check_count(num_tokens)
    k = self.blocks_for(n)
    check_room(self, [s], [k], n // self.block_size)    # full blocks, not ceil
    blocks = self._take(k)
    self._table[s, :k] = blocks
    self._held[s], self._lens[s] = k, n
    self._live.add(s)
    return blocks
""", "OutOfBlocksError"),
    'propose: first match': ('7.propose', """
def ngram_propose(tokens, k, min_n=1, max_n=4):
    tokens = list(tokens)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        for start in range(0, len(tokens) - n):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []
""", 'latest earlier match'),
    'propose: drafts stop before the tail': ('7.propose', """
def ngram_propose(tokens, k, min_n=1, max_n=4):
    tokens = list(tokens)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:min(start + n + k, len(tokens) - n)]
    return []
""", 'latest earlier match'),
    'propose: no match may overlap the tail': ('7.propose', """
def ngram_propose(tokens, k, min_n=1, max_n=4):
    tokens = list(tokens)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - 2 * n, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []
""", 'latest earlier match'),
    'propose: searches a string': ('7.propose', """
def ngram_propose(tokens, k, min_n=1, max_n=4):
    tokens = list(tokens)
    text = " ".join(map(str, tokens))
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = " ".join(map(str, tokens[-n:]))
        at = text.rfind(tail, 0, len(text) - len(tail) - 1)
        if at >= 0:
            start = text[:at].count(" ")
            return tokens[start + n:start + n + k]
    return []
""", 'latest earlier match'),
    'cow: copies every sharer, the last writer too': ('6.cow', """
def _shared_writes(self, rows, n):
    if not n or self.refs.max(initial=0) <= 1:
        return []
    held = self._held[rows]
    last = self._table[rows, np.maximum(held - 1, 0)]
    partial = (self._lens[rows] % self.block_size != 0) & (self.refs[last] > 1)
    return list(zip(rows[partial].tolist(), last[partial].tolist()))
""", 'except the last table still holding it'),
    'cow: copies a full shared last block too': ('6.cow', """
def _shared_writes(self, rows, n):
    if not n or self.refs.max(initial=0) <= 1:
        return []
    held = self._held[rows]
    last = self._table[rows, np.maximum(held - 1, 0)]
    partial = (held > 0) & (self.refs[last] > 1)
    cow, left = [], {}
    for r, b in zip(rows[partial].tolist(), last[partial].tolist()):
        left[b] = left.get(b, int(self.refs[b]))
        if left[b] > 1:
            cow.append((r, b))
            left[b] -= 1
    return cow
""", 'shared partial last block'),
    'cow: partial judged on the new length': ('6.cow', """
def _shared_writes(self, rows, n):
    if not n or self.refs.max(initial=0) <= 1:
        return []
    held = self._held[rows]
    last = self._table[rows, np.maximum(held - 1, 0)]
    partial = ((self._lens[rows] + n) % self.block_size != 0) & (self.refs[last] > 1)
    cow, left = [], {}
    for r, b in zip(rows[partial].tolist(), last[partial].tolist()):
        left[b] = left.get(b, int(self.refs[b]))
        if left[b] > 1:
            cow.append((r, b))
            left[b] -= 1
    return cow
""", 'copy(ies)-on-write'),
    'cow: refs read once, not counted down': ('6.cow', """
def _shared_writes(self, rows, n):
    if not n:
        return []
    cow = []
    for r in rows.tolist():
        h = int(self._held[r])
        if h == 0 or int(self._lens[r]) % self.block_size == 0:
            continue
        b = int(self._table[r, h - 1])
        if self.refs[b] > 1 and sum(1 for x, _ in cow if _ == b) < self.refs[b]:
            cow.append((r, b))
    return cow
""", 'copy(ies)-on-write'),
    'admissible: blocks for n, not held + n': ('5b.admissible', """
def _admissible(self, held, want, out):
    n = want
    while n > 0 and not admits(self.blocks_for(n), self._free(out), self.watermark_blocks,
                               alone=not self.running):
        n = (self.blocks_for(n) - 1) * self.block_size
    return max(n, 0)
""", 'the largest chunk that fits'),
    "admissible: drops block_size tokens, not to a block's end": ('5b.admissible', """
def _admissible(self, held, want, out):
    n = want
    while n > 0 and not admits(self.blocks_for(held + n), self._free(out), self.watermark_blocks,
                               alone=not self.running):
        n -= self.block_size
    return max(n, 0)
""", 'the largest chunk that fits'),
    'admissible: watermark even when nothing runs': ('5b.admissible', """
def _admissible(self, held, want, out):
    n = want
    while n > 0 and not admits(self.blocks_for(held + n), self._free(out), self.watermark_blocks,
                               alone=False):
        n = (self.blocks_for(held + n) - 1) * self.block_size - held
    return max(n, 0)
""", 'the largest chunk that fits'),
    'admissible: ignores the watermark': ('5b.admissible', """
def _admissible(self, held, want, out):
    n = want
    while n > 0 and self.blocks_for(held + n) > self._free(out):
        n = (self.blocks_for(held + n) - 1) * self.block_size - held
    return max(n, 0)
""", 'the largest chunk that fits'),
    "cow: counts down the real reference counts, not a copy": ("6.cow", """
def _shared_writes(self, rows, n):
    if not n or self.refs.max(initial=0) <= 1:
        return []
    held = self._held[rows]
    last = self._table[rows, np.maximum(held - 1, 0)]
    partial = (self._lens[rows] % self.block_size != 0) & (self.refs[last] > 1)
    cow = []
    for r, b in zip(rows[partial].tolist(), last[partial].tolist()):
        if self.refs[b] > 1:
            cow.append((r, b))
            self.refs[b] -= 1
    return cow
""", "but the tables hold each block"),
    "a rank splits wo and w2 by rows too": ("9.shard", """
def rank_state_dict(model, rank, world_size):
    out = {}
    for name, w in model.state_dict().items():
        kind = name.split(".")[-2]
        if kind in COLUMNS + ROWS:                              # every matrix by output features
            w = w[owned(w.shape[0], rank, world_size)]
        elif name == "output.weight" and model.args.tie_word_embeddings:
            continue
        out[name] = w.detach().to("cpu", copy=True).contiguous()
    return out
""", "(columns)"),
    "a rank takes every N-th row, not a block of heads": ("9.shard", """
def rank_state_dict(model, rank, world_size):
    out = {}
    for name, w in model.state_dict().items():
        kind = name.split(".")[-2]
        if kind in COLUMNS:
            w = w[rank::world_size]
        elif kind in ROWS:
            w = w[:, rank::world_size]
        elif name == "output.weight" and model.args.tie_word_embeddings:
            continue
        out[name] = w.detach().to("cpu", copy=True).contiguous()
    return out
""", "and other values"),
    "a rank keeps a tied output layer": ("9.shard", """
def rank_state_dict(model, rank, world_size):
    out = {}
    for name, w in model.state_dict().items():
        kind = name.split(".")[-2]
        if kind in COLUMNS:
            w = w[owned(w.shape[0], rank, world_size)]
        elif kind in ROWS:
            w = w[:, owned(w.shape[1], rank, world_size)]
        out[name] = w.detach().to("cpu", copy=True).contiguous()
    return out
""", "should not hold ['output.weight']"),
    "a rank's weights are views of the model's": ("9.shard", """
def rank_state_dict(model, rank, world_size):
    out = {}
    for name, w in model.state_dict().items():
        kind = name.split(".")[-2]
        if kind in COLUMNS:
            w = w[owned(w.shape[0], rank, world_size)]
        elif kind in ROWS:
            w = w[:, owned(w.shape[1], rank, world_size)].contiguous()
        elif name == "output.weight" and model.args.tie_word_embeddings:
            continue
        out[name] = w
    return out
""", "shares memory"),
    "a worker appends to the lists it was given": ("9.apply", """
def apply_changes(tables, changes):
    out = {s: b for s, b in tables.items() if s not in changes["freed"]}
    for s, ids in changes["appended"].items():
        out[s] += ids
    out.update(changes["replaced"])
    return out
""", "changed the tables it was given"),
    "a worker keeps the freed sequences": ("9.apply", """
def apply_changes(tables, changes):
    out = {s: list(b) for s, b in tables.items()}
    for s, ids in changes["appended"].items():
        out[s] += ids
    out.update({s: list(b) for s, b in changes["replaced"].items()})
    return out
""", "the scheduler holds"),
    "a worker appends a replaced table": ("9.apply", """
def apply_changes(tables, changes):
    out = {s: list(b) for s, b in tables.items() if s not in changes["freed"]}
    for part in ("appended", "replaced"):
        for s, ids in changes[part].items():
            out[s] = out.get(s, []) + list(ids)
    return out
""", "the scheduler holds"),
    "remap pairs from the start, not after the skipped blocks": ("9b.remap", """
def remap(remote_table, local_table, first, end):
    if not 0 <= first <= end <= min(len(remote_table), len(local_table)):
        raise RequestError("bad range")
    return [(remote_table[j], local_table[j - first]) for j in range(first, end)]
""", "block j's pair is"),
    "remap that trusts zip to stop at the shorter table": ("9b.remap", """
def remap(remote_table, local_table, first, end):
    return list(zip(remote_table[first:end], local_table[first:end]))
""", "must raise RequestError"),
    "remap that sends local ids as remote": ("9b.remap", """
def remap(remote_table, local_table, first, end):
    if not 0 <= first <= end <= min(len(remote_table), len(local_table)):
        raise RequestError("bad range")
    return [(local_table[j], remote_table[j]) for j in range(first, end)]
""", "block j's pair is"),
    "quantize: codes from the float32 scale, not the float16 one stored": ("4b.quantize", """
def quantize_int8(x):
    amax = x.abs().amax(-1, keepdim=True).float()
    s = amax / QMAX
    codes = torch.where(s > 0, x.float() / s, 0).round().clamp(-QMAX, QMAX)
    return torch.cat([codes.to(torch.int8), s.half().view(torch.int8)], -1)
""", "with the float16 scale as stored"),
    "quantize: codes truncated toward zero, not rounded": ("4b.quantize", """
def quantize_int8(x):
    scale = (x.abs().amax(-1, keepdim=True).float() / QMAX).clamp(max=65504).half()
    s = scale.float()
    codes = torch.where(s > 0, x.float() / s, 0).clamp(-QMAX, QMAX).to(torch.int8)
    return torch.cat([codes, scale.view(torch.int8)], -1)
""", "round(x / scale)"),
    "quantize: a row of zeros divided by its zero scale": ("4b.quantize", """
def quantize_int8(x):
    scale = (x.abs().amax(-1, keepdim=True).float() / QMAX).clamp(max=65504).half()
    codes = (x.float() / scale.float()).round().clamp(-QMAX, QMAX).to(torch.int8)
    return torch.cat([codes, scale.view(torch.int8)], -1)
""", "scale is 0 gets codes 0"),
    "quantize: a scale past float16's range becomes infinity": ("4b.quantize", """
def quantize_int8(x):
    scale = (x.abs().amax(-1, keepdim=True).float() / QMAX).half()
    s = scale.float()
    codes = torch.where(s > 0, x.float() / s, 0).round().clamp(-QMAX, QMAX)
    return torch.cat([codes.to(torch.int8), scale.view(torch.int8)], -1)
""", "at most 65504"),
    "quantize: the scale's bytes before the codes": ("4b.quantize", """
def quantize_int8(x):
    scale = (x.abs().amax(-1, keepdim=True).float() / QMAX).clamp(max=65504).half()
    s = scale.float()
    codes = torch.where(s > 0, x.float() / s, 0).round().clamp(-QMAX, QMAX)
    return torch.cat([scale.view(torch.int8), codes.to(torch.int8)], -1)
""", "stored in the last 2 bytes"),
    "dequantize: the scale read from the first 2 bytes": ("4b.dequantize", """
def dequantize_int8(packed, dtype=torch.float32):
    scale = packed[..., :2].view(torch.float16).float()
    return (packed[..., 2:].float() * scale).to(dtype)
""", "expected code x scale"),
    "dequantize: multiplied in the output dtype": ("4b.dequantize", """
def dequantize_int8(packed, dtype=torch.float32):
    D = packed.shape[-1] - 2
    return packed[..., :D].to(dtype) * packed[..., D:].view(torch.float16).to(dtype)
""", "expected code x scale"),
}

# Correct solutions shaped differently from the reference: the grader must pass every one.
ALTERNATIVES = {
    "take with randrange": ("2.take", """
def take(self, k):
    out = []
    for _ in range(k):
        i = self._rng.randrange(len(self._ids))
        self._ids[i], self._ids[-1] = self._ids[-1], self._ids[i]
        out.append(self._ids.pop())
    return out
"""),
    "reserve with its own checks, in a different order": ("2.reserve", """
def reserve(self, seq_id, num_tokens):
    n = check_count(num_tokens)
    s = check_new(self, seq_id)
    k = -(-n // self.block_size)
    check_room(self, [s], [k], k)
    blocks = self._take(k)
    for j, b in enumerate(blocks):
        self._table[s, j] = b
    self._lens[s] = n
    self._held[s] = len(blocks)
    self._live.add(s)
    return blocks
"""),
    "grow one sequence at a time, after checking them all": ("2.grow", """
def grow(self, seq_ids, num_new_tokens):
    rows, n = check_live(self, seq_ids, unique=True), check_count(num_new_tokens)
    plan = []
    for s in rows.tolist():
        have, want = int(self._held[s]), self.blocks_for(int(self._lens[s]) + n)
        if want > have:
            plan.append((s, have, want))
    total = sum(want - have for _, have, want in plan)
    if plan:
        check_room(self, [s for s, _, _ in plan], [w for _, _, w in plan], total)
    for s, have, want in plan:
        new = self._take(want - have)
        self._table[s, have:want] = new
        self._held[s] = want
    for s in rows.tolist():
        self._lens[s] += n
    return total
"""),
    "free that reads the row, then clears it whole": ("2.free", """
def free(self, seq_id):
    s = check_one(self, seq_id)
    held = int(self._held[s])
    blocks = [int(b) for b in self._table[s][:held]]
    self._release(blocks)
    self._table[s] = PAD_BLOCK
    self._held[s] = 0
    self._lens[s] = 0
    self._live.remove(s)
    return blocks
"""),
    'admissible: a token at a time': ('5b.admissible', """
def _admissible(self, held, want, out):
    for n in range(want, 0, -1):
        if admits(self.blocks_for(held + n), self._free(out), self.watermark_blocks,
                  alone=not self.running):
            return n
    return 0
"""),
    "fork with a loop over the parent's blocks": ("6.fork", """
def fork(self, parent, child):
    p = check_one(self, parent)
    c = check_new(self, child)
    for j in range(int(self._held[p])):
        b = int(self._table[p, j])
        self._table[c, j] = b
        self.refs[b] += 1
    self._held[c] = self._held[p]
    self._lens[c] = self._lens[p]
    self._live.add(c)
"""),
    "cow row by row, counting the tables still to write": ("6.cow", """
def _shared_writes(self, rows, n):
    if n == 0:
        return []
    out, writers = [], {}
    for r in rows.tolist():
        h = int(self._held[r])
        if h and int(self._lens[r]) % self.block_size:
            b = int(self._table[r, h - 1])
            writers.setdefault(b, []).append(r)
    for b, rs in writers.items():
        copies = min(len(rs), int(self.refs[b]) - 1)     # the last holder keeps the original
        out += [(r, b) for r in rs[:copies]]
    return sorted(out, key=lambda rb: rows.tolist().index(rb[0]))
"""),
    "hashes by recursion over the blocks": ("6.hash", """
def block_hashes(tokens, block_size, parent=None, start=0):
    tokens = list(tokens)
    if (start + 1) * block_size > len(tokens):
        return []
    name = block_hash(parent, tokens[start * block_size:(start + 1) * block_size])
    return [name] + block_hashes(tokens, block_size, name, start + 1)
"""),
    "propose by scanning backwards once per n with a dict of n-grams": ("7.propose", """
def ngram_propose(tokens, k, min_n=1, max_n=4):
    tokens = list(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        latest = {}
        for start in range(len(tokens) - n):              # later starts overwrite earlier ones
            latest[tuple(tokens[start:start + n])] = start
        start = latest.get(tuple(tokens[-n:]))
        if start is not None:
            return tokens[start + n:start + n + k]
    return []
"""),
    "rollback that checks first, then releases block by block": ("7.rollback", """
def rollback(cache, seq_id, num_tokens):
    s = int(seq_id)
    for m in cache.managers:
        if num_tokens < 0 or num_tokens > int(m._lens[s]):
            raise RequestError(f"cannot roll sequence {s} back to {num_tokens} tokens")
    given_back = 0
    for m in cache.managers:
        keep = -(-num_tokens // cache.block_size)
        held = int(m._held[s])
        for j in range(held - 1, keep - 1, -1):
            m._release([int(m._table[s, j])])
            m._table[s, j] = PAD_BLOCK
        m._held[s] = keep
        m._lens[s] = num_tokens
        given_back = held - keep
    if s in getattr(cache, "hashes", {}):
        cache.hashes[s] = cache.hashes[s][:num_tokens // cache.block_size]
    return given_back
"""),
    "write token by token, in Python loops": ("3.write", """
def write_new_kv(k_cache, v_cache, k, v, table, cache_seqlens):
    if k is None:
        return
    block_size = k_cache.shape[1]
    for b in range(k.shape[0]):
        for t in range(k.shape[1]):
            p = int(cache_seqlens[b]) + t
            block = int(table[b, p // block_size])
            k_cache[block, p % block_size] = k[b, t]
            v_cache[block, p % block_size] = v[b, t]
"""),
    "gather by indexing the pool with the table, row by row": ("3.gather", """
def _gather(cache, table, L):
    rows = [torch.cat([cache[int(b)] for b in row]) for row in table]
    return torch.stack(rows)[:, :L]
"""),
    "split slot counts with a Python loop over requests": ("4.split", """
def split_allocated(stored, allocated, final):
    stored, allocated, final = (np.asarray(a, dtype=np.int64) for a in (stored, allocated, final))
    tokens = np.zeros(stored.shape[1:], dtype=np.int64)
    reserved, internal = tokens.copy(), tokens.copy()
    for s, a, f in zip(stored, allocated, final):
        later = np.minimum(a, f)
        if (later < s).any():
            raise RequestError("a request stores more tokens than it holds slots for")
        tokens, reserved, internal = tokens + s, reserved + later - s, internal + a - later
    return tokens, reserved, internal
"""),
    "split free slots with early returns": ("4.free", """
def split_free(free, pieces=None, next_need=None):
    if pieces is None or next_need is None:
        return 0, int(free)
    if next_need > free:
        return 0, int(free)
    external = 0
    for piece in pieces:
        if piece < next_need:
            external += piece
    return int(external), int(free - external)
"""),
    "combine partitions one at a time, rescaling as it goes": ("3b.combine", """
def combine_partitions(m, l, acc):
    run_m, run_l, run_acc = m[0], l[0], acc[0]
    for p in range(1, m.shape[0]):
        new_m = torch.maximum(run_m, m[p])
        safe = torch.where(new_m == float("-inf"), 0.0, new_m)
        a, b = torch.exp(run_m - safe), torch.exp(m[p] - safe)
        run_l = a * run_l + b * l[p]
        run_acc = a[..., None] * run_acc + b[..., None] * acc[p]
        run_m = new_m
    return finish(run_l, run_acc)
"""),
    "attend row by row, written with index_copy": ("1.attend", """
def attend(self, layer, q, k, v):
    rows = self.rows.to(q.device)
    k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
    for i, r in enumerate(rows.tolist()):
        k_cache[r].index_copy_(0, self.positions[i].to(q.device), k[i])
        v_cache[r].index_copy_(0, self.positions[i].to(q.device), v[i])
    seqlens_k = self.cache_seqlens.to(q.device) + q.shape[1]
    L = int(seqlens_k.max())
    return attention_over_cache(q, k_cache[rows, :L], v_cache[rows, :L], seqlens_k)
"""),
    "decodes with a for loop over a snapshot of the running list": ("5.decodes", """
def _schedule_decodes(self, out):
    committed = 0
    for req in list(self.running):
        if req.status != "running":
            break                                  # preempted below, as the newest
        need = self.cache.blocks_to_grow(req.seq_id)
        while self.cache.num_free_blocks - committed < need:
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                break
        if req.status != "running":
            break
        out.decode.append(req)
        committed += need
    return committed
"""),
    "admit with the checks written out, then pop": ("5.admit", """
def _admit(self, out, committed):
    while len(self.waiting) > 0:
        head = self.waiting[0]
        group = self.group(head)
        rows_left = min(len(self.free_rows), self.max_num_seqs - len(self.running))
        blocks = self.blocks_for(head.num_tokens)
        if len(group) > rows_left:
            return
        if not self._fits(blocks, committed):
            return
        self.waiting.popleft()
        for member in group:
            member.seq_id = self.free_rows.pop()
            member.status = "running"
            self.running.append(member)
        out.prefill.append(head)
        committed = committed + blocks
"""),
    "reorder: claim rows with a counter of children": ("6b.reorder", """
def _reorder(self, parents, step):
    if not self.paged:
        copy_rows(self.cache, [self.beams[p].seq_id for p in parents])
        return list(range(len(parents)))
    keep = set(parents)
    for i in range(len(self.beams)):
        if i not in keep:
            s = self.beams[i].seq_id
            self.cache.free(s)
            self.free_rows.append(s)
            step.freed.append(s)
    children, rows = {}, []
    for p in parents:
        parent_row = self.beams[p].seq_id
        children[p] = children.get(p, 0) + 1
        if children[p] == 1:
            rows.append(parent_row)
            continue
        child = min(self.free_rows)
        self.free_rows.remove(child)
        self.cache.fork(parent_row, child)
        step.forks.append((parent_row, child))
        rows.append(child)
    return rows
"""),
    "chunk: the prefilling request found by a search from the newest": ("5b.chunk", """
def _schedule_prompt_chunks(self, out):
    for req in reversed(self.running):
        if req not in self.prefilling:
            continue
        left = req.num_tokens - self.num_computed_tokens(req)
        n = self._growable(req, min(left, self._budget_left(out)), out)
        if n > 0:
            self._schedule(out, req, n, self.cache.blocks_to_grow(req.seq_id, n))
            out.prefill.append(req)
"""),
    "walk written afresh: the block's max first, then l and acc rescaled together": ("3b.walk", """
def walk_blocks(rows, last_key, k_cache, v_cache, table_row, kv_head, n, blocks, scale,
                trace=None, who=(0, 0)):
    R, D = rows.shape
    bs = k_cache.shape[1]
    work = torch.promote_types(rows.dtype, torch.float32)
    rows = rows.to(work)
    m = torch.full((R,), float("-inf"), dtype=work)
    l = torch.zeros(R, dtype=work)
    acc = torch.zeros(R, D, dtype=work)
    for j in blocks:
        block = int(table_row[j])
        pos = j * bs + torch.arange(bs)
        keys = k_cache[block, :, kv_head].to(work)
        values = torch.where((pos < n)[:, None], v_cache[block, :, kv_head].to(work), 0.0)
        scores = (rows @ keys.T * scale).masked_fill(pos[None, :] > last_key[:, None],
                                                     float("-inf"))
        block_max = scores.max(dim=1).values
        m_new = torch.maximum(m, block_max)
        safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        p = torch.exp(scores - safe[:, None])
        old = torch.exp(m - safe)
        l, acc, m = old * l + p.sum(dim=1), old[:, None] * acc + p @ values, m_new
        if trace is not None:
            trace.append(Step(*who, j, block, scores, m, l))
    return m, l, acc
"""),
    "shard by heads, one head at a time": ("9.shard", """
def rank_state_dict(model, rank, world_size):
    import torch
    a, out = model.args, {}
    for name, w in model.state_dict().items():
        kind = name.split(".")[-2]
        if name == "output.weight" and a.tie_word_embeddings:
            continue
        if kind in ("wq", "wk", "wv", "wo"):
            heads = a.n_kv_heads if kind in ("wk", "wv") else a.n_heads
            per = heads // world_size
            mine = range(rank * per, rank * per + per)
            d = a.head_dim
            parts = [w[h * d:(h + 1) * d] if kind != "wo" else w[:, h * d:(h + 1) * d]
                     for h in mine]
            w = torch.cat(parts, dim=0 if kind != "wo" else 1)
        elif kind in ("w1", "w3"):
            w = w.chunk(world_size, dim=0)[rank]
        elif kind == "w2":
            w = w.chunk(world_size, dim=1)[rank]
        out[name] = w.clone().contiguous()
    return out
"""),
    "apply in a loop over the old tables": ("9.apply", """
def apply_changes(tables, changes):
    out = {}
    for s, blocks in tables.items():
        if s in changes["freed"]:
            continue
        out[s] = blocks + changes["appended"].get(s, [])
    for s, blocks in changes["replaced"].items():
        out[s] = [b for b in blocks]
    return out
"""),
    "remap with zip over the slices": ("9b.remap", """
def remap(remote_table, local_table, first, end):
    if first < 0 or end < first or end > len(remote_table) or end > len(local_table):
        raise RequestError(f"remap: first={first}, end={end} do not fit both tables")
    return list(zip(remote_table[first:end], local_table[first:end]))
"""),
    "quantize with a safe divisor instead of a where": ("4b.quantize", """
def quantize_int8(x):
    x = x.float()
    scale = torch.clamp(x.abs().max(dim=-1, keepdim=True).values / 127, max=65504.0)
    scale = scale.to(torch.float16)
    s = scale.to(torch.float32)
    codes = torch.round(x / torch.where(s == 0, torch.ones_like(s), s))
    codes = torch.clamp(codes, -127, 127).to(torch.int8)
    return torch.cat((codes, scale.view(torch.int8)), dim=-1)
"""),
    "dequantize by splitting the slot": ("4b.dequantize", """
def dequantize_int8(packed, dtype=torch.float32):
    codes, scale_bytes = packed.split([packed.shape[-1] - 2, 2], dim=-1)
    scale = scale_bytes.contiguous().view(torch.float16).to(torch.float32)
    return codes.to(torch.float32).mul(scale).to(dtype)
"""),
}
