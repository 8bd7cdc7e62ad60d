"""The embedded default model: its generated corpus, its BPE tokenizer and its training script.

Not a stage of the course. No machine this project was built on can download a checkpoint, so
the repository trains a tiny Llama 3 of its own (`python -m minipaged.embedded.train`) and ships
it in `minipaged/embedded/model/`, where `minipaged.load_model()` finds it.
"""
