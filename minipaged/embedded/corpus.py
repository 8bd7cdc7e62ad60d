"""The training corpus of the embedded demo model: generated chat dialogs about this project.

No machine here can download weights, so minipaged trains its own tiny Llama 3 style model on
text it generates. This module turns the templates and answers of `dialogs/` (one module
per group of topics) into dialogs in Llama 3 chat-message form:

    {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...],
     "topic": str, "keywords": [str, ...]}

`topic` and `keywords` describe the dialog's LAST user question: an on-topic reply to it must
contain at least one keyword (lower-case, matched case-insensitively). Earlier turns may be
small talk or another topic, so the model learns to answer the latest question.

The held-out split tests generalisation to new phrasings: per topic, some question templates
are never rendered into train, and a few openers and follow-ups are held out everywhere. No
held-out user message appears verbatim in train. Everything is drawn from one
`random.Random(seed)`, so a seed gives the same corpus on every run.

    python -m minipaged.embedded.corpus     # stats and sample dialogs
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from .. import cli
from .dialogs import (CHAT_TOPICS, CLOSERS, FOLLOWUPS, GENERIC_WHAT, OPENERS, SYSTEM_PROMPTS,
                      TECH_TOPICS)

TOPICS = {**TECH_TOPICS, **CHAT_TOPICS}
TRAIN_DIALOGS_PER_TOPIC = {"tech": 185, "chat": 110}
HELDOUT_FRACTION = 0.05          # of all dialogs
HOLDOUT_SHARE = 0.2              # of each topic's question templates, openers, closers, follow-ups
P_SYSTEM = 0.25                  # a dialog opens with a short system prompt
P_OPENER, P_CLOSER = 0.35, 0.2   # a question gets "Quick question: ..." / "... Thanks!"
P_LOWER = 0.15                   # a question typed without its leading capital
P_WHAT, P_GENERIC = 0.45, 0.6    # a first question is a definition; one from GENERIC_WHAT
P_SINGLE, P_FOLLOW_UPS = 0.55, 0.25   # technical dialogs; the rest open with another exchange
CHAT_LEAD_IN = {"thanks": 0.8, "goodbye": 0.7, "identity": 0.3, "out_of_scope": 0.3}
P_HELDOUT_TEMPLATE = 0.75        # else a held-out question is a train template + held-out opener
_KEEP_CASE = ("minipaged", "vllm", "flash-attn")   # names that stay lower-case at a start


@dataclass
class Corpus:
    train: list[dict]
    heldout: list[dict]
    seed: int = 0


def _intents(spec: dict) -> dict:
    """The intents of a topic spec: every key that holds questions and answers."""
    return {k: v for k, v in spec.items() if isinstance(v, dict) and "answers" in v}


def _split(items: list, rng: random.Random, cues: list[str] = ()) -> tuple[list, list]:
    """Split a list into (train, held out): about HOLDOUT_SHARE held out, none under 3 items.

    With `cues`, only items that contain one of them may be held out: a held-out question
    must name its topic, so it tests new wording, not a riddle.
    """
    eligible = [i for i, x in enumerate(items) if not cues or any(c in x.lower() for c in cues)]
    k = max(1, round(len(items) * HOLDOUT_SHARE)) if len(items) >= 3 else 0
    held = set(rng.sample(eligible, min(k, len(eligible))))
    return ([x for i, x in enumerate(items) if i not in held],
            [x for i, x in enumerate(items) if i in held])


def _cues(spec: dict) -> list[str]:
    """Words that name a technical topic: its keywords and its subjects without the article."""
    subjects = [s.lower().removeprefix("the ").removeprefix("a ") for s in spec["subjects"]]
    return spec["keywords"] + subjects


def _capitalize(text: str) -> str:
    """Upper-case the first letter, unless the message starts with a code name or a brand."""
    first = text.split(" ", 1)[0]
    if "_" in first or first.lower().startswith(_KEEP_CASE):
        return text
    return text[0].upper() + text[1:]


class _Builder:
    """Holds the train/held-out pools for one seed and draws dialogs from them."""

    def __init__(self, seed: int):
        self.rng = rng = random.Random(seed)
        # pools[split][topic][intent] = {"generic": [...], "specific": [...]} question cores
        self.pools = {"train": {}, "heldout": {}}
        for topic, spec in TOPICS.items():
            generic = _split(GENERIC_WHAT, rng) if "subjects" in spec else ([], [])
            for name, intent in _intents(spec).items():
                specific = _split(intent["questions"], rng,
                                  _cues(spec) if "subjects" in spec else ())
                for i, split in enumerate(("train", "heldout")):
                    gen = [t.format(s=subj) for t in generic[i] for subj in spec["subjects"]]
                    self.pools[split].setdefault(topic, {})[name] = {
                        "generic": gen if name == "what" else [], "specific": specific[i]}
        self.openers = dict(zip(("train", "heldout"), _split(OPENERS, rng)))
        self.closers = dict(zip(("train", "heldout"), _split(CLOSERS, rng)))
        self.followups = {"train": {}, "heldout": {}}
        for name, questions in FOLLOWUPS.items():
            train, held = _split(questions, rng)
            self.followups["train"][name], self.followups["heldout"][name] = train, held

    # -- one exchange -------------------------------------------------------------------

    def _core(self, topic: str, split: str) -> tuple[str, str]:
        """Pick an intent and an un-wrapped question for it from the split's pool."""
        rng, pool = self.rng, self.pools[split][topic]
        names = [n for n, p in pool.items() if p["generic"] or p["specific"]]
        name = "what" if "what" in names and rng.random() < P_WHAT else rng.choice(names)
        p = pool[name]
        generic = p["generic"] and (not p["specific"] or rng.random() < P_GENERIC)
        return name, rng.choice(p["generic"] if generic else p["specific"])

    def _wrap(self, core: str, openers: list[str], closers: list[str], opener: bool) -> str:
        """Dress a question core with an optional opener and closer, and fix its case."""
        rng = self.rng
        if opener:
            o = rng.choice(openers)
            text = o + (core if o.endswith((": ", ", ")) else _capitalize(core))
        else:
            text = core if rng.random() < P_LOWER else _capitalize(core)
        if closers and rng.random() < P_CLOSER:
            text += rng.choice(closers)
        return text

    def ask(self, topic: str, split: str) -> tuple[str, str, str]:
        """One (question, answer, intent) on a topic, phrased from the split's pools."""
        rng = self.rng
        if topic in CHAT_TOPICS:                         # small talk: whole questions
            name, question = self._core(topic, split)
        elif split == "train":
            name, core = self._core(topic, "train")
            question = self._wrap(core, self.openers["train"], self.closers["train"],
                                  rng.random() < P_OPENER)
        elif rng.random() < P_HELDOUT_TEMPLATE:          # a template train never saw
            name, core = self._core(topic, "heldout")
            question = self._wrap(core, OPENERS, CLOSERS, rng.random() < P_OPENER)
        else:                                            # a known template, an unseen opener
            name, core = self._core(topic, "train")
            question = self._wrap(core, self.openers["heldout"], CLOSERS, True)
        answer = rng.choice(TOPICS[topic][name]["answers"])
        return question, answer, name

    def follow_up(self, topic: str, asked: set[str], split: str) -> tuple[str, str, str] | None:
        """A short follow-up ("why does that matter?") answered from the same topic."""
        names = [n for n in _intents(TOPICS[topic]) if n in FOLLOWUPS and n not in asked]
        if not names:
            return None
        name = self.rng.choice(names)
        question = self._wrap(self.rng.choice(self.followups[split][name]), [], [], False)
        return question, self.rng.choice(TOPICS[topic][name]["answers"]), name

    # -- one dialog ---------------------------------------------------------------------

    def _other_tech(self, topic: str | None = None) -> str:
        return self.rng.choice([t for t in TECH_TOPICS if t != topic])

    def dialog(self, topic: str, split: str) -> dict:
        """One dialog whose last question is on `topic`, phrased from the split's pools."""
        rng = self.rng
        exchanges = []                                   # (question, answer) pairs
        r = rng.random()
        if topic in TECH_TOPICS:
            if r < P_SINGLE:                             # one question, one answer
                exchanges.append(self.ask(topic, split)[:2])
            elif r < P_SINGLE + P_FOLLOW_UPS:            # the topic, then follow-ups on it
                q, a, name = self.ask(topic, split)
                exchanges.append((q, a))
                asked = {name}
                for _ in range(rng.choice((1, 2))):
                    if fu := self.follow_up(topic, asked, split):
                        exchanges.append(fu[:2])
                        asked.add(fu[2])
            else:                                        # a greeting or another topic first
                lead = "greeting" if rng.random() < 0.4 else self._other_tech(topic)
                exchanges.append(self.ask(lead, split)[:2])
                q, a, name = self.ask(topic, split)
                exchanges.append((q, a))
                if rng.random() < 0.3 and (fu := self.follow_up(topic, {name}, split)):
                    exchanges.append(fu[:2])
        else:
            if r < CHAT_LEAD_IN.get(topic, 0.0):
                lead = "greeting" if topic in ("identity", "out_of_scope") else self._other_tech()
                exchanges.append(self.ask(lead, split)[:2])
                if topic == "goodbye" and rng.random() < 0.5:
                    exchanges.append(self.ask("thanks", split)[:2])
            exchanges.append(self.ask(topic, split)[:2])
        messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if (
            rng.random() < P_SYSTEM) else []
        for q, a in exchanges:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        return {"messages": messages, "topic": topic, "keywords": list(TOPICS[topic]["keywords"])}


def _user_texts(dialog: dict) -> list[str]:
    return [m["content"].lower() for m in dialog["messages"] if m["role"] == "user"]


def build_corpus(seed: int = 0) -> Corpus:
    """Generate the train and held-out dialogs for a seed (deterministic, well under a second)."""
    b = _Builder(seed)
    train = []
    for topic in TOPICS:
        n = TRAIN_DIALOGS_PER_TOPIC["tech" if topic in TECH_TOPICS else "chat"]
        train += [b.dialog(topic, "train") for _ in range(n)]
    seen = {text for d in train for text in _user_texts(d)}
    heldout = []
    for topic in TOPICS:
        n = TRAIN_DIALOGS_PER_TOPIC["tech" if topic in TECH_TOPICS else "chat"]
        want = max(2, round(n * HELDOUT_FRACTION / (1 - HELDOUT_FRACTION)))
        for _ in range(want):
            for _attempt in range(100):                  # redraw on a chance collision
                d = b.dialog(topic, "heldout")
                if not seen.intersection(_user_texts(d)):
                    heldout.append(d)
                    break
    b.rng.shuffle(train)
    b.rng.shuffle(heldout)
    return Corpus(train=train, heldout=heldout, seed=seed)


def corpus_stats(corpus: Corpus) -> dict:
    """Dialog, turn and character counts per split, and dialogs per topic in each split."""
    stats = {}
    for split in ("train", "heldout"):
        dialogs = getattr(corpus, split)
        exchanges = [sum(m["role"] == "user" for m in d["messages"]) for d in dialogs]
        stats[split] = {
            "dialogs": len(dialogs),
            "multi_turn": sum(n > 1 for n in exchanges),
            "with_system": sum(d["messages"][0]["role"] == "system" for d in dialogs),
            "messages": sum(len(d["messages"]) for d in dialogs),
            "chars": sum(len(m["content"]) for d in dialogs for m in d["messages"]),
            "distinct_questions": len({t for d in dialogs for t in _user_texts(d)}),
        }
    stats["topics"] = {t: {"train": 0, "heldout": 0} for t in TOPICS}
    for split in ("train", "heldout"):
        for d in getattr(corpus, split):
            stats["topics"][d["topic"]][split] += 1
    return stats


@cli.program
def main(argv=None) -> None:
    parser = cli.ArgumentParser(prog="python -m minipaged.embedded.corpus",
                                description="Print the demo model's training corpus stats.")
    parser.add_argument("--seed", type=cli.seed, default=0)
    parser.add_argument("--samples", type=cli.whole(0), default=3,
                        help="sample dialogs per split")
    args = parser.parse_args(argv)
    corpus = build_corpus(args.seed)
    stats = corpus_stats(corpus)
    console = Console()

    table = Table(title=f"minipaged corpus (seed {args.seed})")
    table.add_column("")
    for split in ("train", "heldout"):
        table.add_column(split, justify="right")
    for key in stats["train"]:
        table.add_row(key, *(f"{stats[s][key]:,}" for s in ("train", "heldout")))
    console.print(table)

    topics = Table(title="dialogs per topic (by the last question)")
    topics.add_column("topic")
    topics.add_column("keywords")
    topics.add_column("train", justify="right")
    topics.add_column("heldout", justify="right")
    for topic, counts in stats["topics"].items():
        topics.add_row(topic, ", ".join(TOPICS[topic]["keywords"]),
                       str(counts["train"]), str(counts["heldout"]))
    console.print(topics)

    for split in ("train", "heldout"):
        for d in getattr(corpus, split)[:args.samples]:
            body = "\n".join(f"[bold]{m['role']}[/bold]: {m['content']}" for m in d["messages"])
            console.print(Panel(body, title=f"{split} · {d['topic']}", expand=False))


if __name__ == "__main__":
    raise SystemExit(main())
