"""Look inside attention: the weights of every head, as numbers, pictures and a web page.

Usage:
    python sample.py --prompt "ROMEO:" --attention out/romeo     # writes romeo.html, romeo.png

    from viz.attention_maps import attention_maps, head_entropy, write_html, write_png
    maps = attention_maps(model, ids)          # (n_layer, n_head, T, T), rows sum to 1
    write_html(maps, labels, "romeo.html")     # one self-contained file, no network

The weights come from the model's explicit attention path, softmax(QK^T / sqrt(d_k)), which
computes the same outputs as the fused kernel used for training and sampling. matplotlib
is imported only when a picture is drawn.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from machine.files import atomic_write, write_bytes_atomic
from model import GPT

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

HTML_TEMPLATE = Path(__file__).with_name("inspector.html")


@torch.no_grad()
def attention_maps(model: GPT, ids: list[int]) -> torch.Tensor:
    """(n_layer, n_head, T, T) attention weights for one sequence of at most block_size ids;
    row i is how query position i spreads its attention over key positions 0..i. They are
    read by a forward hook on each layer's attn.attn_dropout, which the explicit attention
    path passes its weights through (in eval mode, unchanged)."""
    device = model.lm_head.weight.device
    weights: list[torch.Tensor] = []
    hooks = [block.attn.attn_dropout.register_forward_hook(
        lambda module, args, out: weights.append(out[0])) for block in model.transformer.h]
    was_training = model.training
    model.eval()
    try:
        model(torch.tensor([ids], device=device), attention="explicit")
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return torch.stack(weights).float().cpu()


def head_entropy(maps: torch.Tensor) -> torch.Tensor:
    """(n_layer, n_head) mean entropy of the attention rows, in nats: near 0 for a head that
    looks at one token, high for a head that spreads its attention evenly."""
    p = maps.clamp_min(1e-12)
    return -(maps * p.log()).sum(-1).mean(-1)


def token_labels(tokenizer, ids: list[int]) -> list[str]:
    """Readable labels: whitespace made visible, one label per token."""
    visible = {"\n": "↵", " ": "·", "\t": "⇥"}
    labels = []
    for i in ids:
        text = tokenizer.decode([i])
        labels.append("".join(visible.get(c, c) for c in text) or "∅")
    return labels


def pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt
    return plt


class LayerPictures:
    """One picture per layer for TensorBoard: heads side by side, queries down, keys across,
    the probe's tokens on both axes. The labelled frame is drawn once; each picture then
    repaints only the heatmap (matplotlib blitting), which keeps logging cheap."""

    GAP = 2  # blank columns between heads

    def __init__(self, labels: list[str], n_head: int) -> None:
        plt = pyplot()
        T = len(labels)
        self.n_head, self.T = n_head, T
        width = n_head * (T + self.GAP) - self.GAP
        self.fig, self.ax = plt.subplots(figsize=(1.2 + 2.2 * n_head, 2.8), dpi=100)
        # animated, so it is left out of the frame and painted on demand
        self.image = self.ax.imshow(np.zeros((T, width)), cmap="viridis", vmin=0.0, vmax=1.0,
                                    animated=True)
        fontsize = 5 if T <= 64 else 0
        self.ax.set_yticks(range(T), labels if fontsize else [], fontsize=fontsize)
        self.ax.set_xticks(range(T), labels if fontsize else [], fontsize=fontsize, rotation=90)
        for head in range(n_head):
            self.ax.text(head * (T + self.GAP) + T / 2, -1, f"head {head + 1}", ha="center",
                         fontsize=7)
        self.fig.subplots_adjust(left=0.06, right=0.99, bottom=0.16, top=0.9)
        self.fig.canvas.draw()
        self.background = self.fig.canvas.copy_from_bbox(self.fig.bbox)

    def draw(self, layer_maps: torch.Tensor) -> np.ndarray:
        """An RGB image (H, W, 3) of one layer's (n_head, T, T) weights."""
        T, gap = self.T, self.GAP
        composite = np.full((T, self.n_head * (T + gap) - gap), np.nan)
        for head in range(self.n_head):
            composite[:, head * (T + gap):head * (T + gap) + T] = layer_maps[head].numpy()
        self.fig.canvas.restore_region(self.background)
        self.image.set_data(composite)
        self.ax.draw_artist(self.image)
        return np.asarray(self.fig.canvas.buffer_rgba())[..., :3].copy()

    def close(self) -> None:
        pyplot().close(self.fig)


def draw_grid(maps: torch.Tensor, labels: list[str]) -> np.ndarray:
    """An RGB image of every layer (rows) and head (columns), tokens on the axes when they fit."""
    plt = pyplot()
    n_layer, n_head, T = maps.size(0), maps.size(1), maps.size(-1)
    fig, axes = plt.subplots(n_layer, n_head, figsize=(2.6 * n_head, 2.6 * n_layer),
                             squeeze=False, dpi=100)
    for layer in range(n_layer):
        for head in range(n_head):
            ax = axes[layer][head]
            ax.imshow(maps[layer, head].numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
            ax.set_title(f"layer {layer + 1} head {head + 1}", fontsize=8)
            ax.set_xticks(range(T), labels if T <= 40 else [], fontsize=5, rotation=90)
            ax.set_yticks(range(T), labels if T <= 40 else [], fontsize=5)
    fig.tight_layout()
    fig.canvas.draw()
    image = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    plt.close(fig)
    return image


def log_attention(writer: SummaryWriter, model: GPT, ids: list[int], pictures: LayerPictures,
                  step: int) -> None:
    """An image per layer (heads side by side, queries down, keys across) and each head's
    attention entropy, so that collapsing or diffuse heads show up as curves."""
    maps = attention_maps(model, ids)
    for layer in range(maps.size(0)):
        writer.add_image(f"attention/layer_{layer + 1}", pictures.draw(maps[layer]), step,
                         dataformats="HWC")
    for (layer, head), entropy in np.ndenumerate(head_entropy(maps).numpy()):
        writer.add_scalar(f"attention_entropy/layer_{layer + 1}_head_{head + 1}", entropy, step)


def write_png(maps: torch.Tensor, labels: list[str], path: str | Path) -> Path:
    """All layers and heads as one grid of heatmaps."""
    path = Path(path)
    with atomic_write(path) as f:  # a write that fails leaves no half picture
        pyplot().imsave(f, draw_grid(maps, labels), format="png")
    return path


def write_html(maps: torch.Tensor, labels: list[str], path: str | Path) -> Path:
    """One self-contained page: pick a layer and head (or all heads), see the heatmap, and
    click or hover a token to highlight the five keys it attends to most."""
    n_layer, n_head, T, _ = maps.shape
    data = {
        "tokens": labels, "n_layer": n_layer, "n_head": n_head, "T": T,
        # float32 in base64 keeps the weights exact, and is smaller than JSON numbers
        "weights": base64.b64encode(maps.numpy().astype("<f4").tobytes()).decode("ascii"),
    }
    page = HTML_TEMPLATE.read_text().replace("/*DATA*/null", json.dumps(data))
    path = Path(path)
    write_bytes_atomic(path, page.encode("utf-8"))
    return path
