"""NanoChat compatibility, checked against transformers' NanoChatForCausalLM: a folder we
read in gives its logits, and a model we export gives our logits in it, with a bigram table
too (through the modeling file that the export carries)."""

import json
from pathlib import Path

import pytest
import torch

from generate import generate
from model import GPT, GPTConfig
from tests.layouts import with_bigrams
from weights.hf import FolderError
from weights.nanochat import BIGRAM_AUTO_MAP, LAYOUT, export_hf_nanochat, load_hf_nanochat

transformers = pytest.importorskip("transformers")  # test-only dependency

SHAPE = dict(vocab_size=50, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=32)
VARIANTS = {"gqa, softcap": dict(num_key_value_heads=2, final_logit_softcapping=15.0),
            "mha, no softcap": dict(num_key_value_heads=4, final_logit_softcapping=None),
            "tied, theta 500": dict(tie_word_embeddings=True,
                                    rope_parameters={"rope_type": "default", "rope_theta": 500.0})}


def nanochat_folder(path: Path, **changes) -> transformers.NanoChatForCausalLM:
    """A random NanoChat model saved by transformers itself, with its weights scaled up so
    that a wrong sign or order shows in the logits."""
    torch.manual_seed(0)
    model = transformers.NanoChatForCausalLM(transformers.NanoChatConfig(**{**SHAPE, **changes}))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4)
    model.eval().save_pretrained(path)
    return model


def tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (3, 32), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_nanochat_folder_read_in_gives_transformers_logits(tmp_path, variant):
    theirs = nanochat_folder(tmp_path, **VARIANTS[variant])
    ours = load_hf_nanochat(tmp_path)
    idx = tokens(SHAPE["vocab_size"])
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], theirs(idx).logits, rtol=1e-5, atol=1e-5)


def exported_model(folder: Path, n_kv_head: int = 2, softcap: float = 15.0,
                   bigram: bool = False) -> GPT:
    """A random model of ours in NanoChat's layout, with its weights scaled up (and its bigram
    table, if any, drawn at random instead of zero), exported to folder."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50, block_size=32, n_layer=2, n_head=4, n_embd=32,
                       n_kv_head=n_kv_head, logit_softcap=softcap, n_inner=80, norm_eps=1e-6,
                       tie_embeddings=False, bigram_embedding=bigram, **LAYOUT)
    ours = GPT(config).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.mul_(4)
    export_hf_nanochat(with_bigrams(ours), folder)
    return ours


@pytest.mark.parametrize("n_kv_head, softcap, bigram", [(2, 15.0, False), (4, 0.0, False),
                                                        (1, 30.0, False), (2, 15.0, True)])
def test_our_model_exported_gives_the_same_logits_and_tokens_in_transformers(tmp_path, n_kv_head,
                                                                            softcap, bigram):
    ours = exported_model(tmp_path / "hf", n_kv_head, softcap, bigram)
    # a bigram table needs the modeling file beside the weights, which config.json names;
    # without one the folder is exactly NanoChat's
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    if bigram:
        assert config["auto_map"] == BIGRAM_AUTO_MAP and config["model_type"] == "nanochat"
        assert files == ["config.json", "model.safetensors", "nanochat_bigram.py"]
    else:
        assert "auto_map" not in config and files == ["config.json", "model.safetensors"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", trust_remote_code=bigram).eval()
    assert type(theirs).__name__ == ("NanoChatBigramForCausalLM" if bigram else "NanoChatForCausalLM")
    idx = tokens(50)
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, ours(idx)[0], rtol=1e-5, atol=1e-5)
        back = load_hf_nanochat(tmp_path / "hf")
        assert back.config == ours.config
        assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(),
                                                   ours.state_dict().values(), strict=True))
        assert torch.equal(back(idx)[0], ours(idx)[0])
        prompt = idx[:1, :4]
        greedy = theirs.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert generate(ours, prompt, 20, temperature=0.0).tolist() == greedy.tolist()


def test_a_bigram_export_generates_left_padded_rows_as_each_alone(tmp_path):
    # a padded row's first token has no predecessor, as at position 0 of a row alone, and
    # each decode step passes the id of the token before it, which the cache already holds
    ours = exported_model(tmp_path / "hf", bigram=True)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf",
                                                               trust_remote_code=True).eval()
    long, short = tokens(50)[0, :6], tokens(50)[1, :3]
    rows = torch.stack([long, torch.cat([torch.zeros(3, dtype=torch.long), short])])
    mask = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])
    with torch.no_grad():
        batch = theirs.generate(rows, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                pad_token_id=0)[:, 6:]
    alone = [generate(ours, row[None], 12, temperature=0.0)[0, len(row):] for row in (long, short)]
    assert batch.tolist() == [row.tolist() for row in alone]


@pytest.mark.parametrize("switch, value", [("embed_norm", False), ("bias", True),
                                           ("norm", "layernorm"), ("pos_embedding", "learned")])
def test_a_layout_nanochat_cannot_hold_is_refused_naming_the_switch(tmp_path, switch, value):
    model = GPT(GPTConfig(vocab_size=50, block_size=32, n_layer=1, n_head=2, n_embd=16,
                          **{**LAYOUT, switch: value}))
    with pytest.raises(FolderError, match=f"a NanoChat folder holds {switch} = "):
        export_hf_nanochat(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_nanochat_folder_whose_weights_disagree_with_its_config_is_one_line(tmp_path):
    nanochat_folder(tmp_path)
    config = (tmp_path / "config.json").read_text().replace('"hidden_size": 32', '"hidden_size": 64')
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(FolderError, match="do not match its config.json"):
        load_hf_nanochat(tmp_path)
