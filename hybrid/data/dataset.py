"""Token stream -> fixed-length GPT samples -> this data-parallel rank's micro-batches.

A sample is ``seq_length + 1`` consecutive tokens (inputs and shifted labels),
cut from the concatenated documents without regard to document boundaries.
Sample ``i`` of the run is window ``perm_e[i mod n]`` of epoch ``e = i // n``,
where each epoch's permutation is drawn from ``seed + e``: the order depends
only on the seed, never on the layout, and ``consumed_samples`` alone says
where a run is.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from hybrid.data.builtin import builtin_documents
from hybrid.data.tokenizer import ByteTokenizer
from hybrid.errors import DataError


def load_token_stream(data_path: str | None, tokenizer: ByteTokenizer) -> np.ndarray:
    """All documents tokenized and joined, each followed by the end-of-document token.

    ``data_path`` None means the built-in corpus; otherwise a UTF-8 text file
    read as one document.
    """
    if data_path is None:
        docs = builtin_documents()
    else:
        if not os.path.isfile(data_path):
            raise DataError(f"--data-path {data_path}: no such file")
        try:
            with open(data_path, encoding="utf-8") as f:
                docs = [f.read()]
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"--data-path {data_path}: cannot read as UTF-8 text ({e})") from e
    dtype = np.uint16 if tokenizer.vocab_size < 2**16 else np.int32
    parts = []
    for doc in docs:
        parts.append(tokenizer.encode_array(doc).astype(dtype, copy=False))
        parts.append(np.asarray([tokenizer.eod], dtype=dtype))
    return np.concatenate(parts)


class GPTSamples:
    """Shuffled fixed-length windows over a token stream, repeating in epochs."""

    def __init__(self, tokens: np.ndarray, seq_length: int, seed: int):
        self.tokens = tokens
        self.seq_length = seq_length
        self.seed = seed
        self.samples_per_epoch = (len(tokens) - 1) // seq_length
        if self.samples_per_epoch < 1:
            raise DataError(f"the data has {len(tokens)} tokens, fewer than one sample of "
                            f"--seq-length {seq_length} + 1")
        self._perm_epoch, self._perm = -1, None

    def _window(self, i: int) -> int:
        epoch, j = divmod(i, self.samples_per_epoch)
        if epoch != self._perm_epoch:
            rng = np.random.default_rng(self.seed + epoch)
            self._perm = rng.permutation(self.samples_per_epoch)
            self._perm_epoch = epoch
        return int(self._perm[j])

    def __getitem__(self, i: int) -> np.ndarray:
        start = self._window(i) * self.seq_length
        return self.tokens[start: start + self.seq_length + 1]


def dp_micro_batches(samples: GPTSamples, consumed_samples: int, global_batch_size: int,
                     micro_batch_size: int, dp_rank: int, dp_size: int,
                     device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This DP rank's micro-batches for the iteration starting at ``consumed_samples``.

    The global batch is samples ``[consumed, consumed + global_batch_size)``;
    DP rank ``r`` takes the ``r``-th contiguous share and cuts it into
    micro-batches of ``(tokens, labels)``, each ``(micro_batch_size, seq_length)``
    int64. TP ranks of one DP rank get identical batches.
    """
    per_rank = global_batch_size // dp_size
    first = consumed_samples + dp_rank * per_rank
    out = []
    for m in range(0, per_rank, micro_batch_size):
        rows = np.stack([samples[first + m + k] for k in range(micro_batch_size)])
        batch = torch.from_numpy(rows.astype(np.int64)).to(device)
        out.append((batch[:, :-1], batch[:, 1:]))
    return out
