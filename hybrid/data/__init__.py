"""Data: tokenizer -> token stream -> fixed-length samples -> this DP rank's micro-batches."""
