"""Attention made visible: the maps are real probabilities, they are the weights the model
computes with, they land in TensorBoard, and the inspector page works in a browser."""

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from model import GPT, GPTConfig
from tests.forked import python
from train import train
from viz.attention_maps import attention_maps, head_entropy, write_html

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=30, block_size=24, n_layer=2, n_head=3, n_embd=24)).eval()


def test_every_row_sums_to_one_and_the_future_is_exactly_zero(model):
    maps = attention_maps(model, list(range(20)))
    assert maps.shape == (2, 3, 20, 20)
    torch.testing.assert_close(maps.sum(-1), torch.ones(2, 3, 20))
    assert torch.all(maps[..., torch.triu(torch.ones(20, 20, dtype=torch.bool), 1)] == 0)


def test_inspector_weights_are_the_ones_the_forward_pass_used(model):
    ids = torch.randint(0, 30, (1, 16), generator=torch.Generator().manual_seed(1))
    maps = attention_maps(model, ids[0].tolist())
    # what the ordinary (fused-kernel) forward pass feeds layer 0's output projection
    captured = {}
    attn = model.transformer.h[0].attn
    handle = attn.c_proj.register_forward_hook(lambda m, inp, out: captured.update(y=inp[0]))
    with torch.no_grad():
        model(ids)
        x = model.transformer.wte(ids) + model.transformer.wpe(torch.arange(16))
        v = attn.c_attn(model.transformer.h[0].ln_1(x)).split(24, dim=2)[2]
    handle.remove()
    v = v.view(1, 16, 3, 8).transpose(1, 2)  # (B, nh, T, hd)
    y = (maps[0].unsqueeze(0) @ v).transpose(1, 2).reshape(1, 16, 24)
    torch.testing.assert_close(y, captured["y"], rtol=1e-5, atol=1e-6)


def test_the_maps_leave_no_hook_behind_and_the_model_in_its_mode(model):
    model.train()
    attention_maps(model, list(range(8)))
    assert model.training
    assert all(not block.attn.attn_dropout._forward_hooks for block in model.transformer.h)


def test_without_positions_attention_is_blind_to_order():
    # Self-attention is permutation-equivariant, so only position embeddings tell it the
    # order. With the causal mask, the clean case is the last position of a single layer,
    # which attends to every token; without position embeddings, its output depends only on
    # which tokens came before it, not on their order. (In deeper layers, each key is shaped
    # by its position's causal prefix.)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=30, block_size=24, n_layer=1, n_head=3, n_embd=24)).eval()
    ids = torch.randint(0, 30, (1, 12), generator=torch.Generator().manual_seed(2))
    order = torch.cat([torch.randperm(11, generator=torch.Generator().manual_seed(3)),
                       torch.tensor([11])])  # the query, the last token, stays where it is
    shuffled = ids[:, order]
    with torch.no_grad():
        with_positions = model(ids)[0][0, -1], model(shuffled)[0][0, -1]
        model.transformer.wpe.weight.zero_()
        without = model(ids)[0][0, -1], model(shuffled)[0][0, -1]
    torch.testing.assert_close(*without, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(*with_positions, atol=1e-3)


def test_entropy_tells_a_focused_head_from_a_diffuse_one():
    focused = torch.eye(8).expand(1, 1, 8, 8)
    uniform = torch.tril(torch.ones(8, 8)) / torch.arange(1, 9).unsqueeze(1)
    entropy = head_entropy(torch.cat([focused, uniform.expand(1, 1, 8, 8)], dim=1))
    assert entropy[0, 0] == 0
    assert entropy[0, 1] == pytest.approx(torch.log(torch.arange(1, 9.0)).mean().item(), rel=1e-5)


def test_training_logs_attention_images_and_entropy(tiny_config):
    result = train(dataclasses.replace(tiny_config, max_iters=10, eval_interval=5,
                                       sample_tokens=0, log_attention=True))
    acc = EventAccumulator(str(result.run_dir), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    assert sorted(acc.Tags()["images"]) == ["attention/layer_1", "attention/layer_2"]
    assert [e.step for e in acc.Images("attention/layer_1")] == [5, 10]
    assert acc.Images("attention/layer_1")[0].width > 100
    entropy = [t for t in acc.Tags()["scalars"] if t.startswith("attention_entropy/")]
    assert len(entropy) == 4  # 2 layers x 2 heads
    assert all(0 < e.value < 4 for e in acc.Scalars(entropy[0]))


def test_sample_cli_writes_the_inspector_page_and_picture(tmp_path, char_data):
    trained = python(["train.py", "--config", "config/tiny.toml", "--data-dir", str(char_data),
                      "--out-dir", str(tmp_path), "--max-iters", "5"], timeout=120)
    assert trained.returncode == 0, trained.stderr
    result = python(["sample.py", "--run", str(tmp_path / "tiny"), "--prompt", "ROMEO:",
                     "--max-new-tokens", "10", "--attention", str(tmp_path / "att" / "romeo")],
                    timeout=120)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "att" / "romeo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "att" / "romeo.html").read_text()
    assert '"T": 16' in page and "http" not in page  # 6 + 10 tokens; the page fetches nothing


CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                    reason="needs Debian's chromium and chromium-driver (.ci/run installs them)")
def test_inspector_page_works_in_headless_chromium(tmp_path, model):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.common.by import By
    maps = attention_maps(model, list(range(20)))
    page = write_html(maps, [f"t{i}" for i in range(20)], tmp_path / "page.html")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=webdriver.ChromeService(CHROMEDRIVER), options=options)
    try:
        driver.get(page.resolve().as_uri())
        # the heatmap is drawn, so the canvas holds many different colours
        colours = driver.execute_script("""
            const c = document.getElementById('heatmap');
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            const seen = new Set();
            for (let i = 0; i < d.length; i += 4) seen.add(d[i] + ',' + d[i+1] + ',' + d[i+2]);
            return [c.width, seen.size];""")
        assert colours[0] > 0 and colours[1] > 20
        tokens = driver.find_elements(By.CSS_SELECTOR, ".tok")
        assert len(tokens) == 20

        def highlighted() -> list[int]:
            return sorted(int(s.get_attribute("data-pos")) for s in
                          driver.find_elements(By.CSS_SELECTOR, ".tok.key"))

        tokens[2].click()
        assert highlighted() == [0, 1, 2]  # a query sees only itself and the past
        tokens[15].click()
        after = highlighted()
        assert len(after) == 5 and max(after) <= 15
        top = maps[0].mean(0)[15, :16].topk(5).indices.sort().values.tolist()
        assert after == top  # the page's default view: layer 1, averaged over heads
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == []
    finally:
        driver.quit()
