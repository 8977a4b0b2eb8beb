"""NanoChat with a bigram table, for transformers: the modeling file that export.py writes
into the folder of a model trained with bigram_embedding = true, and that config.json's
auto_map names. It imports only torch and transformers, because transformers runs it on its
own, outside this project.

Usage:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("out/hf", trust_remote_code=True)

The model is transformers' NanoChatForCausalLM with one more table, model.embed_bigrams:
a learned row for each token, added to the embedding of the token after it, and a last
row (index vocab_size) for the first token, which has no predecessor. The sum is what
NanoChatModel receives as inputs_embeds, so its norm after the embedding applies to both, as
in gptlab's model.py. Without trust_remote_code=True, transformers loads the plain
NanoChatForCausalLM instead, which leaves the table out and gives other logits.
"""

import torch
from torch import nn
from torch.nn import functional as F
from transformers import NanoChatForCausalLM


def ids_before(input_ids: torch.LongTensor, attention_mask: torch.Tensor | None,
                 none: int) -> torch.LongTensor:
    """The id of the token before each of input_ids (B, T), or `none` at position 0 and
    after padding, where the attention mask (B, T) is 0, because a padded row starts there."""
    before = F.pad(input_ids[:, :-1], (1, 0), value=none)  # (B, T), shifted right by one
    if attention_mask is not None and attention_mask.dim() == 2:
        padded = F.pad(attention_mask[:, :-1], (1, 0), value=0) == 0
        before = before.masked_fill(padded, none)
    return before


class NanoChatBigramForCausalLM(NanoChatForCausalLM):
    """NanoChatForCausalLM whose token embedding adds each token's predecessor's bigram row."""

    def __init__(self, config):
        super().__init__(config)
        # a row for each token, and the last for "no predecessor"
        self.model.embed_bigrams = nn.Embedding(config.vocab_size + 1, config.hidden_size)
        self.post_init()

    def forward(self, input_ids=None, previous_ids=None, attention_mask=None,
                position_ids=None, inputs_embeds=None, labels=None, use_cache=None,
                logits_to_keep=0, **kwargs):
        """NanoChatForCausalLM's forward, with the bigram rows added to the embedding.
        previous_ids (B, T) are the ids of the tokens before input_ids; they default to
        input_ids shifted right by one, which is right for a whole sequence but not for new
        tokens after a cache, whose first predecessor is in the cache (generate() passes them)."""
        if input_ids is not None and inputs_embeds is None:
            if previous_ids is None:
                previous_ids = ids_before(input_ids, attention_mask, self.config.vocab_size)
            inputs_embeds = (self.model.embed_tokens(input_ids)
                             + self.model.embed_bigrams(previous_ids))  # (B, T, hidden_size)
            input_ids = None
        return super().forward(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, inputs_embeds=inputs_embeds,
                               labels=labels, use_cache=use_cache,
                               logits_to_keep=logits_to_keep, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, inputs_embeds=None,
                                      **kwargs):
        """transformers' inputs for the next step, and the previous ids of the tokens it
        passes, taken from the whole sequence so far, because with a cache only the new
        tokens are passed and the first one's predecessor is the last token of the cache."""
        inputs = super().prepare_inputs_for_generation(
            input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **kwargs)
        if inputs.get("input_ids") is not None:
            new = inputs["input_ids"].shape[1]
            before = ids_before(input_ids, attention_mask, self.config.vocab_size)
            inputs["previous_ids"] = before[:, -new:].contiguous()
        return inputs
