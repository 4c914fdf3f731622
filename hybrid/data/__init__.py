"""Data: tokenizer -> token stream -> fixed-length samples -> this DP rank's micro-batches.

* :mod:`.tokenizer`   tokenizers: byte-level (the default: no files), GPT-2 BPE, Hugging Face,
                      Megatron's null
* :mod:`.sources`     token sources: documents stored back to back in one flat token array
* :mod:`.indexed`     Megatron's indexed dataset: ``PREFIX.bin`` (tokens) + ``PREFIX.idx``
* :mod:`.hybridx`     hybrid's older token index (``HYBRIDX``), read-only
* :mod:`.builtin`     the built-in corpus: English prose every Python install carries
* :mod:`.vocab_check` token ids outside the tokenizer's vocabulary: a DataError on opening
* :mod:`.blending`    samples drawn from several datasets in fixed proportions, deterministic
* :mod:`.dataset`     token sources -> train/valid/test splits -> shuffled fixed-length
                      samples -> DP micro-batches
"""
