"""Property tests: the tokenizers round-trip whatever text they accept and name what they
refuse; the config parser returns a config or a ConfigError, never anything else."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data.bpe import train_bpe
from data.tokenizer import CharTokenizer, GPT2Tokenizer
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
        assert settings["n_kv_head"] in (overrides.get("n_kv_head", 0), 0)  # 0: n_head's
        assert load_config(None, settings) == cfg
