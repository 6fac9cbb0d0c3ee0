"""Hugging Face Trainer integration (``pip install flatshard[hf]``).

``FlatshardTrainer`` is ``transformers.Trainer`` with the model sharded by ``fs.shard``;
``FlatshardTrainerMixin`` carries the behaviour for other ``Trainer`` subclasses (TRL's
``SFTTrainer``: ``class FlatshardSFTTrainer(FlatshardTrainerMixin, SFTTrainer)``). See
docs/integrations/transformers.md.
"""

from flatshard.integrations.transformers.trainer import (
    FlatshardTrainer,
    FlatshardTrainerMixin,
    no_split_policy,
)

__all__ = ["FlatshardTrainer", "FlatshardTrainerMixin", "no_split_policy"]
