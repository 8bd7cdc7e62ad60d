"""Stage 9: tensor parallelism in a program that runs on (the chat, the server) — the caller's
process is rank 0, and each call that changes its object is made on every rank.

    conv = start_mirrored(model, 2, build_conversation, (...), calls=("reply", "reset"))
    conv.reply("hi")     # sent to ranks 1..N-1 first, then run here; they make the same call
    conv.close()         # every rank ends

`build(shard, *build_args)` makes the object (the chat's Conversation) on each rank from its
shard of the model (`tensor_parallel.load_shard`). Every rank then holds the same object on its
own heads, and since the all-reduces give every rank the same logits, the same calls in the
same order keep them alike: ranks in lockstep, mini-sglang's design. (The engine does not run
this way: its ranks follow one scheduler, `tp_engine.py`.) Only the calls named in `calls` are sent; reading the
object (its cache, its requests, for drawings and the status line) stays on rank 0.
"""

from __future__ import annotations

import io
import pickle
import signal
import time
import types

from .errors import MiniPagedError, TensorParallelError
from .ranks import start_followers
from .tensor_parallel import check_world_size, load_shard, rank_state_dict

FUNCTIONS = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.LambdaType)


class _Pickler(pickle.Pickler):
    """A call's arguments as the other ranks can read them: a request of the object by its index
    in `requests` (each rank has its own request at that index)."""

    def __init__(self, file, obj):
        super().__init__(file)
        self.obj = obj

    def persistent_id(self, value):
        for i, r in enumerate(getattr(self.obj, "requests", ())):
            if value is r:
                return ("request", i)
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, obj):
        super().__init__(file)
        self.obj = obj

    def persistent_load(self, pid):
        return self.obj.requests[pid[1]]


def _message(obj, name, args, kwargs) -> tuple:
    """One call, for the other ranks; a callback argument (it prints, on rank 0) goes as None."""
    args = [None if isinstance(a, FUNCTIONS) else a for a in args]
    kwargs = {k: None if isinstance(a, FUNCTIONS) else a for k, a in kwargs.items()}
    buf = io.BytesIO()
    _Pickler(buf, obj).dump((args, kwargs))
    return name, buf.getvalue()


class Mirrored:
    """Rank 0's object: a call named in `calls` goes to every other rank, then runs here;
    anything else (attributes, other methods) is rank 0's object's own."""

    def __init__(self, obj, followers, calls, cleanup=()):
        self.__dict__.update(_obj=obj, _followers=followers, _calls=frozenset(calls),
                             _cleanup=frozenset(cleanup))

    def __getattr__(self, name):
        value = getattr(self._obj, name)
        if name not in self._calls:
            return value

        def call(*args, **kwargs):
            try:
                self._followers.send(_message(self._obj, name, args, kwargs))
            except TensorParallelError:
                if name not in self._cleanup:   # giving back needs no other rank: rank 0 alone
                    raise
            try:
                return value(*args, **kwargs)
            except RuntimeError:          # a collective broke: name the rank that broke it
                time.sleep(1.0)
                self._followers.check()
                raise
            except KeyboardInterrupt:     # rank 0 stopped mid-call, the others did not: they
                self._followers.close("interrupted in the middle of a call")   # cannot agree
                raise
        return call

    def __setattr__(self, name, value):
        raise AttributeError(f"set {name} on every rank through a call, not on rank 0's object")

    def close(self) -> None:
        """End the other ranks and leave the group (again: nothing)."""
        self._followers.close()


def start_mirrored(model, world_size: int, build, build_args=(), calls=(), cleanup=()
                   ) -> Mirrored:
    """Split `model` over `world_size` ranks (refused before any process starts unless N splits
    its heads), build the object on each rank's shard, and return rank 0's, mirrored. Once a
    rank has died, a call raises TensorParallelError naming it, except the calls of `cleanup`
    (those that only give things back), which then run on rank 0 alone."""
    check_world_size(model.args, world_size)
    device = next(model.parameters()).device
    states = [rank_state_dict(model, r, world_size) for r in range(world_size)]
    followers = start_followers(_follow, world_size, [(model.args, states[r], build, build_args)
                                                      for r in range(1, world_size)], device)
    try:
        shard = load_shard(model.args, 0, world_size, states[0], device)
        return Mirrored(build(shard, *build_args), followers, calls, cleanup)
    except BaseException:
        followers.close()
        raise


def _follow(rank, world_size, device, inbox, args, state, build, build_args) -> None:
    """Ranks 1..N-1: build the object on this rank's shard, then make each call rank 0 sends,
    until it sends None. A refusal (MiniPagedError) is rank 0's too, and changed nothing there:
    the follower goes on. Ctrl-C at the terminal reaches every rank; only rank 0 acts on it (a
    server drains its answers first), and it ends the others."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    obj = build(load_shard(args, rank, world_size, state, device), *build_args)
    while (message := inbox.get()) is not None:
        name, payload = message
        call_args, kwargs = _Unpickler(io.BytesIO(payload), obj).load()
        try:
            getattr(obj, name)(*call_args, **kwargs)
        except MiniPagedError:
            pass
