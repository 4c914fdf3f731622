"""A pipeline stage of the GPT (``layers``, ``pre_process``, ``post_process``): the stages
hold the whole model's parameters under the same names with the same values (init by
name), and chained, stage after stage, they compute the whole model's loss and
gradients exactly; with tied embeddings the first stage's ``wte`` gradient plus the
last stage's copy's is the whole model's."""

import pytest
import torch

from hybrid.config.model import ModelConfig
from hybrid.parallel.state import ParallelState
from models.gpt import GPT


@pytest.mark.parametrize("untie", [False, True])
def test_stages_chained_are_the_whole_model(untie):
    cfg = ModelConfig(num_layers=5, hidden_size=32, num_attention_heads=4,
                      max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
                      untie_embeddings_and_output_weights=untie).with_vocab_size(50)
    g = ParallelState.single().tp_group
    whole = GPT(cfg, g, seed=1)
    splits = (range(0, 2), range(2, 3), range(3, 5))  # uneven, a middle stage of one layer
    stages = [GPT(cfg, g, seed=1, layers=r, pre_process=i == 0, post_process=i == 2)
              for i, r in enumerate(splits)]
    params = dict(whole.named_parameters())
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert ("wte.weight" in dict(stages[2].named_parameters())) is not untie  # the head's copy
    assert set(names) == set(params) and stages[1].blocks[0] is stages[1].blocks[-1]
    for s in stages:
        for n, p in s.named_parameters():
            assert torch.equal(p, params[n]), n
    tokens, labels = torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8))
    loss = whole(tokens, labels)
    loss.backward()
    x = stages[0](tokens)
    x = stages[1](hidden=x)
    piped = stages[2](hidden=x, labels=labels)
    piped.backward()
    assert torch.equal(piped, loss)
    grads: dict[str, torch.Tensor] = {}
    for s in stages:
        for n, p in s.named_parameters():
            grads[n] = grads[n] + p.grad if n in grads else p.grad
    for n, p in params.items():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-6, atol=1e-7, msg=n)
    with pytest.raises(ValueError, match="takes the previous stage's hidden states"):
        stages[1](torch.zeros(2, 8, dtype=torch.long))


def test_an_interleaved_rank_holds_its_chunks_under_the_whole_model_s_names():
    """PP 2 x 2 chunks of a 5-layer GPT (rank 0: embeddings + 0-1 | 3; rank 1: 2 | 4 +
    head): each rank's one module names its blocks by global index, ``forward(chunk=c)``
    runs chunk c, the four chunks chained in stage order are the whole model (loss exact,
    gradients within 1e-6), and ``chunk_parameters`` splits each rank's parameters into
    what each chunk's backward reaches."""
    cfg = ModelConfig(num_layers=5, hidden_size=32, num_attention_heads=4,
                      max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
                      untie_embeddings_and_output_weights=True).with_vocab_size(50)
    g = ParallelState.single().tp_group
    whole = GPT(cfg, g, seed=1)
    ranks = [GPT(cfg, g, seed=1, layers=[range(0, 2), range(3, 4)], pre_process=True,
                 post_process=False),
             GPT(cfg, g, seed=1, layers=[range(2, 3), range(4, 5)], pre_process=False,
                 post_process=True)]
    assert [n for n, _ in ranks[0].named_parameters()][:2] == ["wte.weight", "wpe.weight"]
    assert ranks[0].blocks.ids == (0, 1, 3) and ranks[1].blocks.ids == (2, 4)
    params = dict(whole.named_parameters())
    for r in ranks:
        for n, p in r.named_parameters():
            assert torch.equal(p, params[n]), n
    names = {n for r in ranks for n, _ in r.named_parameters()}
    assert names == set(params)
    tokens, labels = torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8))
    loss = whole(tokens, labels)
    loss.backward()
    x = ranks[0](tokens)  # stage 0: chunk 0 of rank 0
    x = ranks[1](hidden=x)  # stage 1
    x = ranks[0](hidden=x, chunk=1)  # stage 2
    piped = ranks[1](hidden=x, labels=labels, chunk=1)  # stage 3: the loss
    assert torch.equal(piped, loss)
    for r in ranks:
        r.zero_grad()
    ranks[1](hidden=ranks[0](tokens), chunk=0).sum().backward()  # only stages 0 and 1
    for r in ranks:
        chunks = r.chunk_parameters()
        assert sorted(id(p) for c in chunks for p in c) == sorted(id(p) for p in r.parameters())
        assert all(p.grad is not None for p in chunks[0])
        assert all(p.grad is None for p in chunks[1])
    piped = ranks[1](hidden=ranks[0](hidden=ranks[1](hidden=ranks[0](tokens)), chunk=1),
                     labels=labels, chunk=1)
    for r in ranks:
        r.zero_grad()
    piped.backward()
    for r in ranks:
        for n, p in r.named_parameters():
            torch.testing.assert_close(p.grad, params[n].grad, rtol=1e-6, atol=1e-7, msg=n)
    with pytest.raises(ValueError, match="one rank holds the embeddings or the head"):
        GPT(cfg, g, seed=1, layers=[range(0, 2), range(3, 4)])
