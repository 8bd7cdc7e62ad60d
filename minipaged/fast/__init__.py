"""Speed, not a stage: the same Llama, rearranged to decode fast on a CPU.

    fused_llama.py  FusedLlama: fused projections, weights in a layout that streams at memory
                    speed, and for several rows as panels for a C kernel (panels.c: fp32, and
                    half precision unless the CPU has AMX) or packed for
                    oneDNN (matvec.py), rotary on real numbers; a drop-in
                    for a `Llama`
    compiled.py     compile_decode: its decode step compiled into one graph (torch.compile with
                    freezing), and with batches=True its other steps into a second one,
                    attention left to the cache; with fewer_threads=True each also for one
                    thread fewer; optional, eager when it cannot
    operators.py    the compiled steps' two operators (products, attention) with their CPU
                    kernels in C++ (operators.cpp), so that a step's calls stay out of Python
    native_step.py  NativeStep: a decode step of up to 64 rows on the paged cache as one C++ call
                    (operators.cpp), no graph around it; compile_decode attaches it
    contiguous.py   FastContiguousCache: stage 1's contiguous cache, decode row by row over views
    paged.py        FastPagedCache, FastEngine: stage 3's paged cache with a step's bookkeeping
                    planned once for all layers, and stage 3b's C kernel for decode on a CPU
                    (and for stage 7's verify pass, a query at a time), int8 blocks (stage
                    4b) included, quantized in C as they are written (int8_slots.c);
                    FastEngine takes every option of `minipaged.Engine`, speculative decoding
                    included
    kernels.py      kernels(dtype): which kernels run here, in words (the CPU, the vector width
                    the C kernels were built for, products and attention)
    threads.py      AdaptiveThreads: FastEngine's steps on one thread fewer while another
                    process holds a core (each barrier would wait for the thread sharing it);
                    compiled steps only among the thread counts they were compiled for; down
                    to one thread, panels.c's helper takes part in the fp32 products from the
                    held core, in the turns it gets there

Nothing in the stages imports this package: it runs only when asked for, e.g.
`generate(fast, prompts, n, cache="paged", engine_class=FastEngine)`.
`python -m minipaged.benchmarks.smollm2` measures it.
"""

from .compiled import compile_decode
from .contiguous import FastContiguousCache
from .fused_llama import FusedLlama
from .kernels import kernels
from .paged import FastEngine, FastPagedCache, FastSharedPagedCache, fast_backend

__all__ = ["FastContiguousCache", "FastEngine", "FastPagedCache", "FastSharedPagedCache",
           "FusedLlama", "compile_decode", "fast_backend", "kernels"]
