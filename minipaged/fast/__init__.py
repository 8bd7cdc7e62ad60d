"""Speed, not a stage: the same Llama, rearranged to decode fast on a CPU.

    fused_llama.py  FusedLlama: fused projections, weights in a layout that streams at memory
                    speed and packed for oneDNN (matvec.py), rotary on real numbers; a
                    drop-in for a `Llama`
    compiled.py     compile_decode: its decode step compiled into one graph (torch.compile with
                    freezing), attention left to the cache; optional, eager when it cannot

Nothing in the stages imports this package; `python -m minipaged.benchmarks.smollm2` measures it.
"""

from .compiled import compile_decode
from .fused_llama import FusedLlama

__all__ = ["FusedLlama", "compile_decode"]
