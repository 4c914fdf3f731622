"""Megatron-DeepSpeed's GPT (GPTModelPipe, megatron/model/gpt_model.py) as a DeepSpeed
PipelineModule: the layer list and parameter names of GPTModelPipe as read from
Megatron-DeepSpeed's source (its code is not used: it needs CUDA and apex), written here
with plain torch modules for the GPT-2-shaped model of the recorder's GPT_ARGS
(benchmarks/peers/record_deepspeed_checkpoint.py) (LayerNorm, learned
positions, tied embedding and head, tanh GELU, MHA, biases). The layers, by index (each
one's layer_II-model_states.pt holds its own state dict; functions and the head, which
uses the tied embedding through forward_fn, have no file):
  0           the input cast (GPTModelPipe's _to_float16): a function
  1           EmbeddingPipe, TiedLayerSpec "embed" (tied_weight_attr
              word_embeddings_weight): word_embeddings.weight, position_embeddings.weight
  2 .. L+1    ParallelTransformerLayerPipe: input_layernorm, self_attention.
              query_key_value (rows per head: [np, 3, hn]), self_attention.dense,
              post_attention_layernorm, mlp.dense_h_to_4h, mlp.dense_4h_to_h
  L+2         the final LayerNorm: weight, bias
  L+3         the head: TiedLayerSpec "embed" with forward_fn (logits = h @ W^T)
  (L+4        the output cast to fp32, a function, in fp16/bf16 runs only)
and partition_method "type:transformer", as GPTModelPipe. Recorded by DeepSpeed's own
PipelineEngine, not by Megatron-DeepSpeed: the fixture is GPTModelPipe's layout, not a
Megatron-DeepSpeed run's files (no client state: Megatron-DeepSpeed adds its args, RNG
and iteration there). The vocabulary is unpadded (100 rows; Megatron-DeepSpeed pads to
--make-vocab-size-divisible-by, and its softmax covers the padding rows, which hybrid's
masks out).
"""

from __future__ import annotations

import torch
from torch import nn

MDS_HEADS = 2


def mds_input(tokens):
    """Layer 0: GPTModelPipe's input cast (fp32 here: the tokens as they are)."""
    return tokens


class EmbeddingPipe(nn.Module):
    """Word and learned position embeddings (GPTModelPipe's layer 1, tied as "embed")."""

    def __init__(self, hidden: int, vocab: int, positions: int):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(positions, hidden)
        nn.init.normal_(self.word_embeddings.weight, std=0.02)
        nn.init.normal_(self.position_embeddings.weight, std=0.02)

    @property
    def word_embeddings_weight(self):
        return self.word_embeddings.weight

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.word_embeddings(tokens) + self.position_embeddings(pos)[None]


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.query_key_value = nn.Linear(hidden, 3 * hidden)
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, c = x.shape
        hn = c // self.heads
        qkv = self.query_key_value(x).view(b, s, self.heads, 3, hn)  # Megatron's per head
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))  # (b, np, s, hn)
        scores = q @ k.transpose(-1, -2) / hn ** 0.5
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        return self.dense((probs @ v).transpose(1, 2).reshape(b, s, c))


class _MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden, ffn)
        self.dense_4h_to_h = nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.dense_4h_to_h(nn.functional.gelu(self.dense_h_to_4h(x), approximate="tanh"))


class ParallelTransformerLayerPipe(nn.Module):
    """A pre-LN transformer layer under GPTModelPipe's parameter names."""

    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden, eps=1e-5)
        self.self_attention = _Attention(hidden, heads)
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=1e-5)
        self.mlp = _MLP(hidden, ffn)

    def forward(self, x):
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


def mds_logits(embedding, hidden):
    """The head (GPTModelPipe's _logits_helper): the tied word embedding transposed."""
    return hidden @ embedding.word_embeddings_weight.t()


def mds_loss(logits, labels):
    """Cross entropy, the mean over the micro-batch's tokens (GPT_ARGS' data: no padding,
    every token counted)."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                       labels.reshape(-1))


def mds_output(logits):
    """Layer L+4 of a bf16 run: GPTModelPipe's output cast to fp32 (float16_to_fp32)."""
    return logits.float()


def mds_layers(layer_spec, tied_layer_spec, layers: int = 2, hidden: int = 16,
               heads: int = MDS_HEADS, ffn: int = 64, vocab: int = 100,
               positions: int = 16, bf16: bool = False) -> list:
    """GPTModelPipe's layer list (above) for GPT_ARGS' model (``bf16``: with the output
    cast after the head)."""
    embed = (EmbeddingPipe, hidden, vocab, positions)
    return [mds_input,
            tied_layer_spec("embed", *embed, tied_weight_attr="word_embeddings_weight"),
            *[layer_spec(ParallelTransformerLayerPipe, hidden, heads, ffn)
              for _ in range(layers)],
            layer_spec(nn.LayerNorm, hidden, eps=1e-5),
            tied_layer_spec("embed", *embed, forward_fn=mds_logits,
                            tied_weight_attr="word_embeddings_weight"),
            *([mds_output] if bf16 else [])]


def mds_config(stage: int) -> dict:
    """GPT_ARGS' optimizer as a ds_config: AdamW, lr 0.003, no weight decay, no clipping,
    micro-batches of 2 rows, 4 a step."""
    return {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
            "gradient_clipping": 0.0, "steps_per_print": 10 ** 6,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "betas": [0.9, 0.999],
                                                      "eps": 1e-8, "weight_decay": 0.0,
                                                      "torch_adam": True}},
            "zero_optimization": {"stage": stage}}
