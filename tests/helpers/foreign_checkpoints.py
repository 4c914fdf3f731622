"""Save directories other frameworks write, for the tests that hybrid refuses to load them."""

from __future__ import annotations

# What each framework leaves in a save directory (DeepSpeed 0.19.8's engine.save_checkpoint;
# Megatron-LM's legacy and torch_dist formats; torch.distributed.checkpoint.save): the
# files that show the format, empty, as the refusal reads names only.
FOREIGN = {
    "DeepSpeed": {"latest": "global_step4", "global_step4/mp_rank_00_model_states.pt": "",
                  "global_step4/zero_pp_rank_0_mp_rank_00_optim_states.pt": ""},
    "Megatron-LM": {"latest_checkpointed_iteration.txt": "10",
                    "iter_0000010/mp_rank_00/model_optim_rng.pt": ""},
    "Megatron-LM torch_dist": {"latest_checkpointed_iteration.txt": "10",
                               "iter_0000010/metadata.json": '{"sharded_backend": "torch_dist"}',
                               "iter_0000010/common.pt": "", "iter_0000010/.metadata": ""},
    "torch.distributed.checkpoint (DCP)": {".metadata": "", "__0_0.distcp": ""},
}


def write_foreign(root, files):
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
