"""Integrations with the trainers people already use (optional extras; never imported by
``import flatshard``).

- ``flatshard.integrations.lightning``: ``FlatshardStrategy`` for ``lightning.Trainer`` and
  ``lightning.Fabric`` (``pip install flatshard[lightning]``), registered as
  ``strategy="flatshard"`` when imported.
- ``flatshard.integrations.transformers``: ``FlatshardTrainer``, a drop-in
  ``transformers.Trainer`` (``pip install flatshard[hf]``).
"""
