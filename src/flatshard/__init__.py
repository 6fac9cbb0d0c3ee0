"""flatshard: Fully Sharded Data Parallel (ZeRO-3) training for PyTorch."""
