"""The real Gemma 3 270M Q4_K_M file (the `gemma3` fixture): its SentencePiece vocabulary of 262,144 tokens
against transformers' tokenizer built from the same GGUF, chat prompts against the official Gemma 3 template,
and the CLI's inspect, tokenize and a short NumPy generation (marked slow). The tokenizers are built once
for the module (about 1 s ours, 4 s transformers')."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_chat import GEMMA3_OFFICIAL, GEMMA_CONVERSATIONS, transformers_render
from test_tokenizer import TEXTS

from clirun import run
from llamacli.chat.template import ChatTemplate, encode_prompt
from llamacli.ggufio.file import open_gguf
from llamacli.tokenizer.tokenizer import StreamDecoder, Tokenizer

GEMMA_TEXTS = TEXTS + [
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    " <start_of_turn> spaced <end_of_turn> ",
    "<bos>Hello<eos><pad><unk><mask>[multimodal]<start_of_image><unused0>",
    "a  b   c    d\n\n\n\ne\t\tf",  # Gemma has whole tokens for runs of spaces and of line breaks
    "\u00a0non-breaking\u2009thin\u3000ideographic\u200bzero-width",
    "1234567890 00 007 3.0e-12 ½ ² ①",
    "    indented = {'code': [1, 2]}  # comment\n\treturn x ** 2\n",
]


@pytest.fixture(scope="module")
def md(gemma3: Path) -> dict:
    return dict(open_gguf(gemma3).metadata)


@pytest.fixture(scope="module")
def tok(md: dict) -> Tokenizer:
    return Tokenizer.from_metadata(md)


@pytest.fixture(scope="module")
def hf_tok(gemma3: Path):
    """transformers' GemmaTokenizer built from the GGUF itself (its GGUF tokenizer converter)."""
    transformers = pytest.importorskip("transformers")
    return transformers.GemmaTokenizer.from_pretrained(str(gemma3.parent), gguf_file=gemma3.name)


def test_the_file_is_what_the_issue_says(md: dict, tok: Tokenizer) -> None:
    assert md["general.architecture"] == "gemma3" and md["gemma3.block_count"] == 18
    assert tok.kind == "spm" and tok.vocab_size == 262_144 and "tokenizer.chat_template" not in md
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (2, 1, True)
    assert tok.token_id("<end_of_turn>") in tok.eog_ids and tok.eos_id in tok.eog_ids


def test_ids_and_text_match_transformers(tok: Tokenizer, hf_tok) -> None:
    """Special tokens parsed (as transformers always does), with and without BOS; decoding of the same ids
    with and without special tokens; streaming decoding equal to decoding at once. (Without special=True a
    control token's text is plain text, as in llama.cpp: transformers has no such mode.)"""
    for text in GEMMA_TEXTS:
        ids = hf_tok.encode(text, add_special_tokens=False)
        assert tok.encode(text, special=True, add_bos=False) == ids, text
        assert tok.encode(text, special=True) == hf_tok.encode(text), text
        assert tok.decode(ids) == hf_tok.decode(ids), text
        # `</s>` is user-defined in the file; llama.cpp makes it a control end-of-generation token (by its text),
        # so with special tokens off it prints nothing, where transformers prints it.
        shown = [i for i in ids if i != tok.token_id("</s>")]
        assert tok.decode(ids, special=False) == hf_tok.decode(shown, skip_special_tokens=True), text
        stream = StreamDecoder(tok)
        assert "".join(map(stream.feed, ids)) + stream.flush() == hf_tok.decode(ids), text


def test_a_long_text_in_pieces_gives_the_ids_of_the_whole(tok: Tokenizer, hf_tok) -> None:
    text = "\n".join(GEMMA_TEXTS) * 40  # long enough to be tokenized in pieces
    assert tok.encode(text, special=True, add_bos=False) == hf_tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("conversation", GEMMA_CONVERSATIONS)
def test_chat_prompt_tokens_match_the_official_template(md: dict, tok: Tokenizer, hf_tok, conversation) -> None:
    """The built-in Gemma format, tokenized: the ids of transformers' rendering of the official Gemma 3
    template, tokenized by transformers (and by us), BOS once."""
    template = ChatTemplate.from_metadata(md)
    assert template.source == "builtin:gemma"
    ids = encode_prompt(tok, template.render(conversation))
    official = transformers_render(GEMMA3_OFFICIAL, conversation, bos_token="<bos>", eos_token="<eos>")
    assert ids == hf_tok.encode(official, add_special_tokens=False) == encode_prompt(tok, official)
    assert ids[0] == tok.bos_id and ids[1] != tok.bos_id and ids[-3:] == [tok.token_id("<start_of_turn>"), 4368, 107]


def test_cli_inspect_and_tokenize(gemma3: Path) -> None:
    r = run("inspect", str(gemma3), "--json")
    assert r.code == 0, r.err
    info = json.dumps(json.loads(r.out))
    assert "gemma3" in info and "262144" in info
    r = run("tokenize", "-m", str(gemma3), "--chat", "--text", "Hi", "--system", "Be brief.", "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["pieces"] == ["<bos>", "<start_of_turn>", "user", "\n", "Be", "▁brief", ".", "\n\n",
                                           "Hi", "<end_of_turn>", "\n", "<start_of_turn>", "model", "\n"]


@pytest.mark.slow
def test_cli_generate_on_the_numpy_backend(gemma3: Path) -> None:
    """Greedy, raw: transformers 5.x on the same file continues " the capital of the country of France. It is
    the largest city in France and"; four tokens, but loading the weights for NumPy takes 4-10 s."""
    r = run("generate", "-m", str(gemma3), "-p", "The capital of France is", "--raw", "--greedy", "-n", "4",
            "--backend", "numpy")
    assert r.code == 0, r.err
    assert r.out.rstrip("\n") == " the capital of the"


GREEDY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "Translate to German: good morning",
]


@pytest.fixture(scope="module")
def pair(gemma3: Path):
    """Our NumPy model and transformers' Gemma3ForCausalLM loaded from the same GGUF (float32, CPU)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from llamacli.engine.generate import Model

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gemma3.parent), gguf_file=gemma3.name,
                                                           dtype=torch.float32).eval()
    return Model(gemma3, backend="numpy", ctx=1024), hf, torch


def test_logits_match_transformers_past_the_window(pair) -> None:
    """Last-position logits within test_model_reference's tolerance (1e-3 of the largest) for a short prompt
    and one of 600 tokens, longer than the local layers' window of 512 (so the sliding-window mask and the
    two RoPE bases matter)."""
    import numpy as np

    from llamacli.models.block import prefill

    ours, hf, torch = pair
    rng = np.random.default_rng(5)
    for n in (7, 600):
        ids = [2] + rng.integers(3, 262_000, size=n - 1).tolist()
        ours.seq.clear()
        got = ours.backend.to_host(prefill(ours.backend, ours.cfg, ids, 0))[-1]
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0, -1].numpy()
        assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max(), n


@pytest.mark.parametrize("prompt", GREEDY_PROMPTS)
def test_greedy_32_tokens_match_transformers(pair, prompt) -> None:
    ours, hf, torch = pair
    ids = ours.tokenize(prompt)
    c = ours.complete(ids, max_tokens=32, temperature=0.0)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32, eos_token_id=None, pad_token_id=0)
    ref = out[0, len(ids):].tolist()
    n = len(c.tokens)
    assert c.tokens == ref[:n]
    assert n == 32 or ref[n] in ours.tokenizer.eog_ids
