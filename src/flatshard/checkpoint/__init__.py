"""Sharded checkpoints on torch.distributed.checkpoint, and full safetensors export/import.

``save``/``load`` write and read each rank's shards under the original parameter names, so a
checkpoint loads at any world size and wrap plan; saves are atomic and verified; loading never
unpickles foreign code. See docs/checkpoints.md.
"""

from flatshard.checkpoint.commit import latest_checkpoint
from flatshard.checkpoint.exporting import export_checkpoint, export_safetensors
from flatshard.checkpoint.full_file import load_full_state_dict_from_file
from flatshard.checkpoint.loader import load
from flatshard.checkpoint.pretrained import save_pretrained
from flatshard.checkpoint.saver import SaveHandle, save

__all__ = [
    "SaveHandle",
    "export_checkpoint",
    "export_safetensors",
    "latest_checkpoint",
    "load",
    "load_full_state_dict_from_file",
    "save",
    "save_pretrained",
]
