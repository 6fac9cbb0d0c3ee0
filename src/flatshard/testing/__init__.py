"""Test tools for flatshard's own test suite (not imported by ``import flatshard``).

- ``nccl_semantics``: the ``strict_async`` process group, Gloo underneath, NCCL's rules on top
  (outputs are garbage until ``wait()``, inputs and buffers must stay put while in flight).
- ``virtual_device``: a second, virtual CPU device for the compute side, so that a CPU run can
  tell host (offloaded) tensors from compute-device tensors at every collective.
"""
