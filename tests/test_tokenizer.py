from warmspec.tokenizer import TextStream, Tokenizer

from tiny import byte_tokenizer


def stream(tok: Tokenizer, ids, stop=()):
    ts = TextStream(tok, stop)
    pieces = [ts.push(i) for i in ids]
    pieces.append(ts.finish())
    return pieces, ts


def test_utf8_never_split_across_deltas():
    tok = byte_tokenizer()
    text = "héllo → 世界 🎉 ok"
    ids = list(text.encode("utf-8"))  # one token per byte: multi-byte characters span tokens
    pieces, ts = stream(tok, ids)
    assert "".join(pieces) == text == ts.text
    assert all("\ufffd" not in p for p in pieces)
    # the emoji's four bytes arrive one by one; it must come out whole in one piece
    assert "🎉" in pieces


def test_utf8_streaming_default_tokenizer(default_lm):
    tok = default_lm.tokenizer
    text = "Ünïcödé: 数学 and emoji 🧪🚀 — done"
    ids = tok.encode(text)
    # byte-level BPE splits at least one character across tokens here
    assert any(tok.token_bytes[i] and not _valid_utf8(tok.token_bytes[i]) for i in ids)
    pieces, ts = stream(tok, ids)
    assert ts.text == text
    assert all("\ufffd" not in p for p in pieces)


def _valid_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_stop_string_is_cut_and_held_back():
    tok = byte_tokenizer()
    ids = list(b"answer: 42\nEND of text")
    pieces, ts = stream(tok, ids, stop=["\nEND"])
    assert ts.text == "answer: 42"
    assert ts.stopped
    # no piece ever showed part of the stop string
    assert all("\n" not in p for p in pieces)


def test_partial_stop_prefix_released_when_it_diverges():
    tok = byte_tokenizer()
    pieces, ts = stream(tok, list(b"a <|e|> b <|end|> c"), stop=["<|end|>"])
    assert ts.text == "a <|e|> b "
    pieces, ts = stream(tok, list(b"abc <|en"), stop=["<|end|>"])
    assert ts.text == "abc <|en" and not ts.stopped  # finish releases the held-back tail


def test_gguf_tokenizer_round_trip_and_digits(default_lm):
    tok = default_lm.tokenizer
    for text in ["def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
                 "  leading spaces\tand tabs", "numbers 12345 and 3.14159"]:
        assert tok.decode(tok.encode(text)) == text
    # SmolLM2's pre-tokenizer splits every digit on its own
    ids = tok.encode("12345")
    assert len(ids) == 5


def test_chat_template_and_special_tokens(default_lm):
    tok = default_lm.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\n")  # SmolLM2 adds its default system turn
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text)
    im_start = tok.backend.token_to_id("<|im_start|>")
    assert ids[0] == im_start and ids.count(im_start) == 3
    assert tok.backend.token_to_id("<|im_end|>") in tok.eos_ids
