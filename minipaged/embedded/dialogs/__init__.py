"""The words of the demo model's training corpus: topics, question templates and answers.

`minipaged/embedded/corpus.py` turns these into dialogs. Everything here is plain data, written so that a reader
can check each claim: the numbers come from DESIGN.md's "facts from the field" (the vLLM
paper, flash-attn, Meta's Llama 3 code, the seed articles).

Questions are stored in mid-sentence case ("what is {s}?"); `corpus.py` capitalises them at
the start of a message. `{s}` in a template is filled with one of a topic's `subjects`.
Every answer of a topic contains at least one of that topic's `keywords` (lower-case).
"""

from .attention_topics import ATTENTION_TOPICS
from .block_topics import BLOCK_TOPICS
from .memory_topics import KV_CACHE_TOPICS
from .model_topics import MODEL_TOPICS
from .phrasing import CLOSERS, FOLLOWUPS, GENERIC_WHAT, OPENERS, SYSTEM_PROMPTS
from .serving_topics import SERVING_TOPICS
from .small_talk import CHAT_TOPICS

# In the order the corpus generator walks them (the order fixes the seeded corpus).
TECH_TOPICS = {**KV_CACHE_TOPICS, **BLOCK_TOPICS, **ATTENTION_TOPICS, **SERVING_TOPICS,
               **MODEL_TOPICS}
