"""How questions are asked: definition templates, openers, closers, follow-ups, system prompts."""

# Definition questions that fit any topic's subject noun phrase.
GENERIC_WHAT = [
    "what is {s}?",
    "what's {s}?",
    "can you explain {s}?",
    "explain {s}.",
    "explain {s} to me.",
    "tell me about {s}.",
    "describe {s}.",
    "what do people mean by {s}?",
    "I keep hearing about {s}. What is it?",
    "give me a short explanation of {s}.",
    "how would you describe {s}?",
    "help me understand {s}.",
    "could you walk me through {s}?",
    "what should I know about {s}?",
    "in a sentence or two, what is {s}?",
    "define {s}.",
    "what is meant by {s}?",
    "can you tell me what {s} is?",
    "I don't really get {s}. Can you explain it?",
    "what's the idea behind {s}?",
    "what exactly is {s}?",
    "do you know what {s} is?",
    "please explain {s} briefly.",
    "summarize {s} for me.",
    "what does {s} refer to?",
    "could you define {s} for me?",
    "I'm reading about {s}. What is it?",
    "{s}: what is it?",
    "so what is {s}, exactly?",
    "what is the gist of {s}?",
]

# Put before a question; those ending in ": " or ", " keep the question in mid-sentence case.
OPENERS = [
    "Hi! ", "Hey, ", "Quick question: ", "Question: ", "I'm new to this. ",
    "Sorry if this is basic, but ", "So, ", "One more thing: ", "I was wondering, ", "Okay, ",
    "Hello. ", "Can I ask something? ", "I'm studying LLM inference. ", "Out of curiosity, ",
    "Here's a question: ", "Help me out: ", "Hey there! ", "Right, ",
]

CLOSERS = [
    " Thanks!", " Keep it short.", " In simple words, please.", " Thanks in advance.",
    " Please be brief.", " I'm a beginner.", " Just the main idea.",
    " One or two sentences is fine.", " Thank you.",
]

# Follow-up questions by intent; the answer comes from the dialog's topic.
FOLLOWUPS = {
    "why": [
        "why does that matter?", "why is that useful?", "why do we need it?",
        "what problem does that solve?", "and why is that important?", "what's the benefit?",
        "why would anyone do that?", "why bother?",
    ],
    "how": [
        "how does that work?", "how does it work in practice?", "how is it done?",
        "and how is that implemented?", "what are the mechanics?", "how does it happen, step by step?",
        "how does that play out at runtime?",
    ],
    "example": [
        "can you give an example?", "example please?", "show me an example.",
        "what would that look like?", "could you make it concrete?", "any concrete numbers?",
        "give me a concrete case.",
    ],
    "more": [
        "tell me more.", "go on.", "can you say more?", "anything else I should know?",
        "what else?", "interesting, tell me more.", "what's the next detail?",
    ],
}

SYSTEM_PROMPTS = [
    "You are minipaged's tiny demo model. Answer briefly.",
    "You are a helpful assistant that explains LLM inference.",
    "Answer in one to three sentences.",
    "You are a concise tutor for KV caches and PagedAttention.",
    "You are a helpful assistant.",
    "Be brief and accurate.",
    "You explain how vLLM manages memory.",
    "You are a friendly teaching assistant for the minipaged repository.",
]


def _i(questions, answers):
    """One intent: the questions that ask for it and the answers that fit all of them."""
    return {"questions": questions, "answers": answers}
