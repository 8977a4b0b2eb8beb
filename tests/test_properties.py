"""Property tests: the tokenizers round-trip whatever text they accept and name what they
refuse; the config parser returns a config or a ConfigError, never anything else; every
sampling filter, at any value its range allows, keeps at least the likeliest token."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data.bpe import train_bpe
from data.bpe_tokenizers import GPT2Tokenizer
from data.tokenizer import CharTokenizer
from generate import check_sampling, filter_top_k, filter_top_p, sample_next
from training.config import FIELDS, ConfigError, TrainConfig, load_config

ALPHABET = "\n !',-.:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
CHAR = CharTokenizer(ALPHABET)


@given(st.text(alphabet=ALPHABET))
def test_char_tokenizer_round_trips_text_of_its_alphabet(text):
    assert CHAR.decode(CHAR.encode(text)) == text


@given(st.text(alphabet=ALPHABET), st.text(min_size=1).filter(lambda t: set(t) - set(ALPHABET)))
def test_char_tokenizer_names_characters_it_lacks(known, foreign):
    missing = sorted(set(foreign) - set(ALPHABET))
    with pytest.raises(ValueError, match="not in this model's vocabulary") as info:
        CHAR.encode(known + foreign)
    assert repr(missing[0]) in str(info.value)


@pytest.fixture(scope="module")
def gpt2():
    return GPT2Tokenizer()


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=200)
@given(text=st.text())
def test_gpt2_tokenizer_round_trips_any_text(gpt2, text):
    assert gpt2.decode(gpt2.encode(text)) == text


@pytest.fixture(scope="module")
def bpe():
    """A 300-token BPE learned from English, so that most of any text is bytes, not merges."""
    return train_bpe(["To be, or not to be, that is the question. " * 3, ALPHABET * 2,
                      "naïve café 東京 😀 12345 don't we'll\n\n\tend"] * 40, vocab_size=300)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=300)
@given(text=st.text())
def test_a_trained_bpe_round_trips_any_text(bpe, text):
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text and bpe.encode_array(text).tolist() == ids
    assert all(0 <= i < bpe.eot_token for i in ids)


values = st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=False), st.booleans(),
                   st.text(max_size=10))


@given(st.dictionaries(st.one_of(st.sampled_from(sorted(FIELDS)), st.text(max_size=12)),
                       values, max_size=6))
def test_config_parser_gives_a_config_or_a_config_error(overrides):
    try:
        cfg = load_config(None, overrides)
    except ConfigError as e:
        assert str(e) and "\n" not in str(e)
    else:
        assert isinstance(cfg, TrainConfig)
        settings = cfg.to_dict()
        assert all(settings[k] == v for k, v in overrides.items() if k != "n_kv_head")
        assert settings["n_kv_head"] in (overrides.get("n_kv_head", 0), 0)  # 0 means as many as n_head
        assert load_config(None, settings) == cfg


# finite float32 logits, from the largest negative to the largest positive
logit_rows = st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1,
                      max_size=40)
# each setting over its whole range: any non-negative finite temperature, any k >= 1, any
# p in (0, 1], from the smallest float above 0 (5e-324)
temperatures = st.one_of(st.just(0.0), st.floats(0.0, 1.7e308, exclude_min=True),
                         st.sampled_from([5e-324, 1e-300, 1e-46, 1e-38, 1e30, 1e300]))
top_ks = st.one_of(st.none(), st.integers(1, 2**62), st.just(1))
top_ps = st.one_of(st.none(), st.floats(5e-324, 1.0), st.sampled_from([5e-324, 1e-300, 1e-46]))


@settings(max_examples=400, deadline=None)
@given(logit_rows, temperatures, top_ks, top_ps, st.integers(0, 2**32))
def test_every_sampling_filter_keeps_the_likeliest_token(row, temperature, top_k, top_p, seed):
    check_sampling(temperature, top_k, top_p)  # each value is inside its allowed range
    logits = torch.tensor([row])
    best = logits.max()  # compare values, because in a tie a filter may keep another token than argmax
    assert filter_top_k(logits, top_k or 1).max() == best
    assert filter_top_p(logits, top_p or 1.0).max() == best
    picked = sample_next(logits, temperature, top_k, top_p, torch.Generator().manual_seed(seed))
    assert torch.isfinite(logits[0, picked.item()])
    if temperature == 0 or top_k == 1:
        assert logits[0, picked.item()] == best  # narrowed to the likeliest token
    elif top_p is not None and top_p < 0.5 / len(row):
        # the likeliest after temperature scaling, which may round distinct logits to one value
        finfo = torch.finfo(torch.float32)
        scaled = (logits - best) / min(max(temperature, finfo.tiny), finfo.max)
        assert scaled[0, picked.item()] == 0
