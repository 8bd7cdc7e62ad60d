"""Build it yourself: a task per idea, stubs a learner fills in, and a grader made of the
project's own kind of checks (not a stage: it may import every stage; nothing imports it).

    python -m minipaged.exercises list                       every task, tab-separated
    python -m minipaged.exercises start [DIR]                stub files (default ./workspace)
    python -m minipaged.exercises check TASK|STAGE|all [--workspace DIR] [--reference]
    python -m minipaged.exercises mutants [TASK] [--limit N] how many wrong solutions fail

A task is one function or method of the package (`tasks.py`). Its stub is generated from the
package's own source: signature, docstring, shape hints, and a body that raises
NotImplementedError naming the lesson section. `check` puts the learner's function in the
package's place and runs the rest of the package around it (`grader.stand_in`), so a correct
allocator makes the paged cache produce the contiguous cache's tokens. `compare(stage,
workspace)` runs a stage's drawing on the learner's code beside the reference's, for a notebook.
"""

from .compare import compare
from .tasks import STAGES, TASKS, Task

__all__ = ["compare", "STAGES", "TASKS", "Task"]
