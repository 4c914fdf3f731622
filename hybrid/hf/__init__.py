"""Hugging Face names and layouts, as pure tensor functions (no transformers import).

* :mod:`.gpt2`  GPT-2 <-> hybrid's GPT; dispatches Llama/Qwen2 configs to :mod:`.llama`
* :mod:`.llama` Llama and Qwen2 <-> hybrid's GPT with the Llama-family options
* :mod:`.mixtral` Mixtral <-> hybrid's Llama-shaped GPT with MoE layers
* :mod:`.qwen2_moe` Qwen2-MoE <-> hybrid's Llama-shaped GPT with MoE layers, a gated shared
  expert and dense layers where it has them
* :mod:`.qwen3` Qwen3 and Qwen3-MoE configs (``--kv-channels``, ``--qk-layernorm``); their
  weights map through :mod:`.llama` and :mod:`.qwen2_moe`
"""
