"""Sharded checkpoints on torch.distributed.checkpoint, and full safetensors export/import.

``save``/``load`` write and read each rank's shards under the original parameter names, so a
checkpoint loads at any world size and wrap plan; saves are atomic and verified; loading never
unpickles foreign code. See docs/checkpoints.md.
"""

from .commit import latest_checkpoint
from .exporting import export_checkpoint, export_safetensors
from .full_file import load_full_state_dict_from_file
from .loader import load
from .pretrained import save_pretrained
from .saver import SaveHandle, save

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
