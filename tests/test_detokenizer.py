import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer, byte_token_ids, decoder
from engine.sampling_params import SamplingParams

MULTI_BYTE_TEXTS = [
    "Héllo wörld, ça va? Ñandú, façade, naïve résumé.",
    "日本語のテキストと中文字符，还有한국어 문장.",
    "Emoji: 😀🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 done",
    "Mixed: café ☕ 東京 🗼 Ωμέγα ∑∫√ — “quotes” … end",
]


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer.encode("<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n")


def stream(tokenizer, prompt_ids, output_ids, params, step=1):
    """Feeds output_ids `step` tokens at a time -> (deltas, emitted text after each step, stop)."""
    det = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    deltas, emitted, stop = [], [], None
    for i in range(0, len(output_ids), step):
        stop = det.update(output_ids[i:i + step])
        finished = stop is not None or i + step >= len(output_ids)
        deltas.append(det.get_delta(finished))
        emitted.append("".join(deltas))
        if stop is not None:
            break
    assert det.get_delta(True) == ""
    return det, deltas, emitted, stop


@pytest.mark.parametrize("text", MULTI_BYTE_TEXTS)
@pytest.mark.parametrize("step", [1, 3])
def test_multi_byte_deltas_concatenate_to_the_full_decode(tokenizer, prompt_ids, text, step):
    ids = tokenizer.encode(text)
    det, deltas, _, stop = stream(tokenizer, prompt_ids, ids, SamplingParams(), step)
    assert stop is None
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == det.output_text == tokenizer.decode(ids) == text


def test_multi_byte_texts_really_split_characters_across_tokens(tokenizer):
    # Guards the test above: single tokens of these texts decode to partial characters.
    partial = [i for text in MULTI_BYTE_TEXTS for i in tokenizer.encode(text)
               if "\ufffd" in tokenizer.decode([i])]
    assert len(partial) > 10


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab cé世界😀🎉\n.,'Ωñ")), max_size=40))
def test_random_text_deltas_match_decode(tokenizer, prompt_ids, text):
    ids = tokenizer.encode(text)
    det, deltas, _, _ = stream(tokenizer, prompt_ids, ids, SamplingParams())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_trailing_partial_character_is_flushed_when_finished(tokenizer, prompt_ids):
    ids = tokenizer.encode("ok 😀")
    cut = ids[:-1]  # ends inside the emoji's bytes
    assert tokenizer.decode(cut).endswith("\ufffd")
    det = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams())
    for token in cut:
        det.update([token])
    streaming = det.get_delta(False)
    assert streaming == "ok"  # the last token, " " + the emoji's first bytes, waits for the rest
    assert streaming + det.get_delta(True) == det.output_text == tokenizer.decode(cut)
    # that flush comes after the sequence ended: a stop string in it cuts the text (which never
    # holds one) but is not what ended the sequence
    for stop, text in ((" ", "ok"), ("\ufffd", "ok ")):
        det = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(stop=[stop]))
        assert [det.update([t]) for t in cut] == [None] * len(cut)
        assert det.get_delta(True) == det.output_text == text and det.stop_string is None


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, prompt_ids, skip):
    ids = tokenizer.encode("Hi there<|im_end|>") + [tokenizer.eos_token_id]
    det, deltas, _, _ = stream(tokenizer, prompt_ids, ids, SamplingParams(skip_special_tokens=skip))
    text = "".join(deltas)
    assert text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in text) is (not skip)
    assert text.startswith("Hi there")


TEXT = "The answer is forty-two, said the computer, after a very long pause."


def split_stop(tokenizer, stop):
    """Asserts that `stop` spans token boundaries in TEXT (so the test exercises splitting)."""
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode(TEXT)]
    assert not any(stop in p for p in pieces)
    return stop


@pytest.mark.parametrize("step", [1, 2])
def test_stop_string_split_across_tokens_is_cut_and_never_partly_emitted(tokenizer, prompt_ids, step):
    stop = split_stop(tokenizer, "two, said")
    expected = TEXT[:TEXT.index(stop)]
    params = SamplingParams(stop=["never", stop])
    det, deltas, emitted, matched = stream(tokenizer, prompt_ids, tokenizer.encode(TEXT), params, step)
    assert matched == stop == det.stop_string
    assert det.output_text == "".join(deltas) == expected
    # Every intermediate stream is a prefix of the final text: nothing was emitted then retracted.
    assert all(expected.startswith(e) for e in emitted)


def test_include_stop_str_in_output(tokenizer, prompt_ids):
    stop = split_stop(tokenizer, "two, said")
    params = SamplingParams(stop=stop, include_stop_str_in_output=True)
    det, deltas, emitted, matched = stream(tokenizer, prompt_ids, tokenizer.encode(TEXT), params)
    expected = TEXT[:TEXT.index(stop) + len(stop)]
    assert matched == stop
    assert det.output_text == "".join(deltas) == expected
    assert all(expected.startswith(e) for e in emitted)


def test_the_stop_string_completed_first_wins(tokenizer, prompt_ids):
    params = SamplingParams(stop=["pause", "said"])
    det, _, _, matched = stream(tokenizer, prompt_ids, tokenizer.encode(TEXT), params)
    assert matched == "said" and det.output_text == TEXT[:TEXT.index("said")]


@pytest.mark.parametrize("stop, text", [(["l", "h"], " he"), (["h", "l"], " "), (["lo", "el"], " hel")])
def test_one_token_completing_two_stop_strings_ends_at_the_one_listed_first(tokenizer, prompt_ids, stop, text):
    """vLLM's rule (its check_stop_strings walks the list), wherever the other one starts."""
    (token,) = tokenizer.encode(" hello", add_special_tokens=False)
    det, deltas, _, matched = stream(tokenizer, prompt_ids, [token], SamplingParams(stop=stop))
    assert (matched, det.output_text, "".join(deltas)) == (stop[0], text, text)


def test_multi_byte_stop_string(tokenizer, prompt_ids):
    text = "先生は東京に住んでいます。😀 then more"
    det, deltas, emitted, matched = stream(tokenizer, prompt_ids, tokenizer.encode(text),
                                           SamplingParams(stop="住ん"))
    assert matched == "住ん"
    assert "".join(deltas) == det.output_text == "先生は東京に"


def test_deltas_hold_back_a_possible_stop_prefix(tokenizer, prompt_ids):
    det = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(stop="STOP!"))
    det.update(tokenizer.encode("Hello wor"))
    assert det.get_delta(False) == "Hello"  # the last len("STOP!") - 1 = 4 chars are held
    det.update(tokenizer.encode("ld"))
    assert det.get_delta(False) == " w"
    assert det.get_delta(True) == "orld"


@pytest.mark.parametrize("min_tokens, text", [(0, "a"), (1, "a"), (2, "a, b"), (3, "a, b"), (4, "a, b, c")])
def test_stop_strings_wait_for_min_tokens(tokenizer, prompt_ids, min_tokens, text):
    """vLLM's rule: a stop string must end in a token after the first min_tokens ("a" "," " b" ","
    ...: with min_tokens 2 the first "," is the 2nd token, too early; with 4 the second is the 4th)."""
    ids = tokenizer.encode("a, b, c, d")
    assert [tokenizer.decode([t]) for t in ids[:4]] == ["a", ",", " b", ","]
    det, _, _, matched = stream(tokenizer, prompt_ids, ids, SamplingParams(stop=",", min_tokens=min_tokens))
    assert matched == ","
    assert det.output_text == text


def test_no_stop_means_no_hold_back(tokenizer, prompt_ids):
    det = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams())
    det.update(tokenizer.encode("Hello"))
    assert det.get_delta(False) == "Hello"
    assert det.update(tokenizer.encode(" world")) is None
    assert det.get_delta(False) == " world"


def test_decoder_calls_the_rust_tokenizer_with_the_same_result(tokenizer):
    """The detokenizer's decode skips transformers' argument handling where it only forwards."""
    from transformers import AutoTokenizer

    decode = decoder(tokenizer)
    assert decode == tokenizer._tokenizer.decode
    rng = random.Random(0)
    specials = tokenizer.all_special_ids
    for _ in range(200):
        ids = [rng.choice(specials) if rng.random() < 0.2 else rng.randrange(tokenizer.vocab_size)
               for _ in range(rng.randrange(0, 12))]
        for skip in (True, False):
            assert decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)
    # A tokenizer that cleans up spaces after decoding keeps its own decode.
    cleaning = AutoTokenizer.from_pretrained(tokenizer.name_or_path, clean_up_tokenization_spaces=True)
    assert decoder(cleaning) == cleaning.decode


NEVER = "\x07never\x07"  # a stop string no token decodes to: keeps a detokenizer decoding per token


@settings(max_examples=80, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_decoding_when_read_gives_what_decoding_each_token_gives(tokenizer, prompt_ids, data, skip):
    """Without stop strings tokens are decoded only when the text is read; every read must return
    exactly what per-token decoding had by then: multi-byte characters split across tokens and
    across reads, special tokens (skipped or not), several tokens per update."""
    pool = sorted({i for t in MULTI_BYTE_TEXTS for i in tokenizer.encode(t)} | set(tokenizer.all_special_ids))
    ids = data.draw(st.lists(st.sampled_from(pool), max_size=30))
    lazy = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(skip_special_tokens=skip))
    eager = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(skip_special_tokens=skip, stop=[NEVER]))
    read, i = "", 0
    while i < len(ids):
        step = data.draw(st.integers(1, 4))
        lazy.update(ids[i:i + step])
        for token in ids[i:i + step]:
            eager.update([token])
        i += step
        if data.draw(st.booleans()):
            read += lazy.get_delta(False)
            assert read == lazy.output_text == eager.output_text
    assert read + lazy.get_delta(True) == eager.get_delta(True)  # the flush of a trailing partial character too
    assert lazy.output_text == eager.output_text


def test_detokenize_off_gives_no_text(tokenizer, prompt_ids):
    ids = tokenizer.encode("Some words the model wrote.")
    det, deltas, _, stop = stream(tokenizer, prompt_ids, ids, SamplingParams(detokenize=False))
    assert stop is None and set(deltas) == {""} and det.output_text == "" and det.num_output_tokens == len(ids)


def test_spaces_between_special_tokens_reaches_a_slow_tokenizers_decode(tokenizer, prompt_ids):
    calls = []

    class Slow:  # what the option means to a sentencepiece tokenizer: whether special tokens get spaces around them
        def decode(self, ids, **kwargs):
            calls.append(kwargs)
            return tokenizer.decode(ids, skip_special_tokens=kwargs["skip_special_tokens"])

    ids = tokenizer.encode("Hello<|im_end|>")
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    det, *_ = stream(Slow(), prompt_ids, ids, params)
    assert det.output_text == "Hello<|im_end|>"
    assert calls and all(c == {"skip_special_tokens": False, "spaces_between_special_tokens": False} for c in calls)


# -- byte-fallback tokenizers (Llama 2, Mistral: <0xXX> tokens) ------------------------------------
PIECES = ["▁", "a", "▁a", "b", "▁b", "▁hello", "hello", "é", "▁✓", "x"]


@pytest.fixture(scope="module")
def byte_fallback_tokenizer():
    """A Llama-2-style fast tokenizer: specials, the 256 byte tokens, a few pieces; its decoder
    replaces ▁, joins byte runs (one U+FFFD per byte of an invalid run) and strips one leading space."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab.update({p: 259 + i for i, p in enumerate(PIECES)})
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(s, special=True) for s in ("<unk>", "<s>", "</s>")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)


def test_byte_tokens_are_found_only_in_a_byte_fallback_vocabulary(tokenizer, byte_fallback_tokenizer):
    assert byte_token_ids(byte_fallback_tokenizer) == frozenset(range(3, 259))
    assert byte_token_ids(tokenizer) == frozenset()  # SmolLM2's byte-level BPE


def _read(tok, prompt, ids, params, per_token: bool) -> tuple[str, str]:
    det = IncrementalDetokenizer(tok, prompt, params)
    deltas = []
    for t in ids:
        det.update([t])
        if per_token:
            deltas.append(det.get_delta(False))
    deltas.append(det.get_delta(True))
    return det.output_text, "".join(deltas)


def test_byte_runs_read_the_same_however_they_are_read(byte_fallback_tokenizer):
    """A run's text can change with its next byte: decoded whole, a valid character followed by a
    stray byte is an invalid run, one U+FFFD per byte. What was read stands and the stray byte is
    one U+FFFD (vLLM restarts its DecodeStream there), whether the text is streamed, read once at
    the end, or checked for a stop string after every token."""
    tok = byte_fallback_tokenizer
    byte, piece = (lambda b: 3 + b), tok.convert_tokens_to_ids
    prompt = [1, piece("▁hello")]
    cases = {(byte(0xE2), byte(0x9C), byte(0x93), byte(0x80), piece("▁a")): "✓� a",  # HF's decode: "���� a"
             (byte(0xCE), byte(0xA9), byte(0xD5), piece("a")): "Ω�a",
             (byte(0x46), byte(0xF9), piece("▁a")): "F� a",
             (piece("▁a"), byte(0xE2), byte(0x9C), byte(0x93), piece("▁b"), byte(0xE2), byte(0x9C)): " a✓ b��"}
    rng = random.Random(0)
    alphabet = [byte(b) for b in (0x41, 0x80, 0x93, 0x9C, 0xA9, 0xC3, 0xCE, 0xE2, 0xF0, 0x9F)] + \
        [piece(p) for p in PIECES]
    fuzz = [tuple(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(300)]
    for ids in [*cases, *fuzz]:
        reads = {_read(tok, prompt, ids, params, per_token)
                 for params in (SamplingParams(), SamplingParams(stop=["\x00never"])) for per_token in (False, True)}
        assert len(reads) == 1, (ids, reads)
        text, streamed = reads.pop()
        assert text == streamed, ids
        if ids in cases:
            assert text == cases[ids], ids
        elif not set(ids) & byte_token_ids(tok):  # no byte token: the decode of the whole
            assert text == tok.decode(prompt + list(ids))[len(tok.decode(prompt)):], ids
    # a prompt that ends inside a character: no context (as before); its byte and the output's are read apart
    assert _read(tok, prompt + [byte(0xC3)], [byte(0xA9), piece("▁b")], SamplingParams(), True) == ("� b", "� b")
