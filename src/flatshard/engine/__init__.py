"""The data flow of a sharded model: plan, init, state, units, flat layout, buffers, hooks.

See docs/engine.md for which file owns which step.
"""
