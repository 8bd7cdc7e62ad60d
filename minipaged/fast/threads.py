"""Fewer threads while another process holds a core: `AdaptiveThreads`, on by default in
`FastEngine` (`FastEngine(..., adaptive_threads=False)` turns it off).

Why. A step runs on torch's pool of OpenMP threads, one per core by default: a decode step is a
few hundred short parallel regions (matrix products, element-wise ops, the C kernel's
attention), each ending at a barrier where every thread waits for the last. When another
CPU-bound process shares a core with one of those threads, the scheduler gives that thread
half of its core in time slices, and every barrier waits for it: the whole step runs at the
pace of the slowed thread, and the other core sits idle in between. Measured on a 2-core
machine, SmolLM2-135M in float32, `FastEngine` eager, one Python busy loop beside it:

    threads                    batch 1 (ms a token)    16 requests (tokens/s)
    2, quiet                          50                      97
    1, quiet                          70                      66
    2, beside the busy loop          109  (0.46x)             48  (0.49x)
    1, beside the busy loop           74  (0.68x)             64  (0.66x)

One thread on the free core beats two threads sharing with the busy one. (The spinning that
made it much worse is handled apart: `import minipaged` sets a short GOMP_SPINCOUNT.) With the
governor on, the same machine, batch 1 beside the busy loop took 64 ms a token against 97 ms
with the count fixed at 2 (quiet: 43 and 42 ms), and 16 requests kept 0.64 of their quiet rate
against 0.50 (`python -m minipaged.benchmarks.busy_machine --ways fixed minipaged`).

One thread fewer leaves the held core's turns unused, and on a machine of two cores a step on
one thread reads the weights at one core's speed. So while the count is down to one thread,
the governor turns on panels.c's helper (`matvec.panel_helper`): one more thread, placed on the
cores other than the one the step runs on, which takes chunks of panels of each fp32 product
when the scheduler gives it a turn, and whose unfinished chunks the step takes back rather than
wait for its next turn (the end of panels.c says how). Its CPU time is this process's own, so
the governor does not count it as another process's; bf16 products (oneDNN's) leave it idle,
asleep; where it cannot start, the products stay on one thread. Measured on SmolLM2's one-row
products (a step's 121, every weight read once), beside a Python busy loop pinned to core 1:
25.8 ms with the helper against 36.6 on one thread alone (quiet, on two threads: 18.3). In
`python -m minipaged.benchmarks.serving_peers --busy` (fp32, compiled, two runs), batch 1 kept
0.62 and 0.64 of its quiet rate against 0.50 and 0.54 before, and 16 requests 0.75 and 0.69
against 0.57 and 0.54 (vLLM's CPU build, the same runs: 0.54 and 0.55, 0.54 and 0.53).

How. Every `interval` seconds (half a second; a step only reads the clock in between) the
governor reads how many seconds the machine's cores were busy (/proc/stat, the cores this
process may run on) and how many of them were this process's own (`time.process_time`): the
rest, per second of wall time, is the share of cores that other processes hold. When they hold
at least `drop_at` (0.6) of a core more than counted so far, one core is counted as theirs and
the step runs on one thread fewer (`torch.set_num_threads`; the C kernel reads the same
count); when they use no more than `rise_at` (0.3) of the last core counted as theirs, that
core comes back. The gap between the two thresholds keeps it from flapping. The thread count
never goes above the one the user set, nor below 1, and `restore` puts the user's count back
when a run ends.

Compiled steps. torch.compile guards each graph on the thread count it was compiled for (a
graph's loops are written for that many threads), so a step run under another count compiles
its graph again, tens of seconds in the middle of a run: 16 requests beside the busy loop
fell to 9.6 tokens/s against 44.3 with the count left alone. So on a model with compiled steps
the governor only picks among the counts its graphs were compiled for (`counts`, from
`compile_decode(..., fewer_threads=True)`: the user's count and one fewer), and leaves a model
compiled for the user's count alone. Measured the same way, compiled, 16 requests of at most
40 tokens beside the busy loop: on 2 threads the engine kept 0.40 of its quiet rate in fp32
and 0.31 in bf16; dropping to the one-thread graphs, 0.59-0.63 and 0.65 (batch 1, fp32: 0.32
against 0.57), its quiet rate unchanged.
"""

from __future__ import annotations

import os
import time

import torch

from . import matvec


def cpus_allowed() -> list[int]:
    """The cores this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def busy_seconds(cpus, stat: str | None = None) -> float | None:
    """Seconds the cores `cpus` have spent busy since boot (user, nice, system, irq, softirq,
    steal: all but idle and I/O wait), from /proc/stat's text (read if not given); None where
    there is no /proc/stat."""
    if stat is None:
        try:
            with open("/proc/stat") as f:
                stat = f.read()
        except OSError:
            return None
    wanted, ticks = {f"cpu{c}" for c in cpus}, 0
    for line in stat.splitlines():
        name, *fields = line.split()
        if name in wanted:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
            ticks += user + nice + system + irq + softirq + steal
    return ticks / os.sysconf("SC_CLK_TCK")


class AdaptiveThreads:
    """torch's thread count, one fewer for each core other processes hold (see the module's
    docstring). `tick()` before each step; `restore()` when a run ends. `update(wall, busy,
    own)` is the decision alone, on readings given in seconds: wall-clock time, the machine's
    busy time on our cores, this process's CPU time."""

    def __init__(self, interval: float = 0.5, drop_at: float = 0.6, rise_at: float = 0.3):
        self.interval, self.drop_at, self.rise_at = interval, drop_at, rise_at
        self.counts = None           # the thread counts allowed (compiled graphs'); None: any
        self.cpus = cpus_allowed()
        self.user_threads = None     # the count the user set, while a run is on
        self.held = 0                # cores counted as held by other processes
        self.others = 0.0            # cores' worth other processes used in the last interval
        self.last = None             # the readings at the start of the interval
        self.helper = False          # panels.c's helper is on (down to one thread)

    def read(self):
        """(wall, busy, own) seconds now, or None where /proc/stat cannot be read."""
        busy = busy_seconds(self.cpus)
        return None if busy is None else (time.monotonic(), busy, time.process_time())

    def tick(self) -> None:
        """Before a step: at the first, remember the user's count; then, once an interval has
        passed, read the machine and set the count for the steps that follow."""
        if self.user_threads is None:
            self.user_threads, self.held, self.last = torch.get_num_threads(), 0, None
        if self.user_threads == 1:
            return
        now = time.monotonic()
        if self.last is None or now - self.last[0] >= self.interval:
            readings = self.read()
            if readings is not None:
                threads = self.update(*readings)
                if threads != torch.get_num_threads():
                    torch.set_num_threads(threads)
                helper = threads == 1 < self.user_threads
                if helper or self.helper:       # on (placed anew at each reading), or off
                    matvec.panel_helper(helper)
                    self.helper = helper

    def update(self, wall: float, busy: float, own: float) -> int:
        """Take one reading; returns the thread count the next steps should run on."""
        if self.user_threads is None:
            self.user_threads = torch.get_num_threads()
        if self.last is not None and wall > self.last[0]:
            w0, b0, o0 = self.last
            self.others = max(0.0, (busy - b0) - (own - o0)) / (wall - w0)
            while self.held < len(self.cpus) - 1 and self.others >= self.held + self.drop_at:
                self.held += 1
            while self.held > 0 and self.others <= self.held - 1 + self.rise_at:
                self.held -= 1
        self.last = (wall, busy, own)
        return self.threads()

    def threads(self) -> int:
        """The user's count on a quiet machine; else the cores left free, at most the user's
        count and at least 1; with `counts`, the largest of them no more than that, else
        the smallest of them."""
        if self.held == 0:
            return self.user_threads
        free = max(1, min(self.user_threads, len(self.cpus) - self.held))
        if self.counts is None:
            return free
        fewer = [n for n in self.counts if n <= free]
        return max(fewer) if fewer else min(self.counts, default=self.user_threads)

    def restore(self) -> None:
        """The run is over: the user's thread count back, and a fresh start for the next run."""
        if self.user_threads is not None and torch.get_num_threads() != self.user_threads:
            torch.set_num_threads(self.user_threads)
        if self.helper:
            matvec.panel_helper(False)
            self.helper = False
        self.user_threads, self.held, self.last = None, 0, None
