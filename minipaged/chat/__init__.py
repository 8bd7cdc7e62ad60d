"""The chat application: talk to a Llama 3 and watch its paged KV cache (`python -m minipaged.chat`).

Not a stage of the course: it uses them. `conversation.py` keeps one conversation as one
sequence of a cache, `app.py` is the terminal program, `demo.py` serves scripted conversations
at once on the engine, `options.py` reads the command line.
"""
