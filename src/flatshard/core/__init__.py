"""The plain path of a sharded model, readable top to bottom with no switch set.

Reading order: plan (``build``) -> ``layout`` -> ``flat_group`` -> ``unit`` -> ``gather`` ->
``reduce`` -> ``streams`` -> ``hooks`` -> ``state``. docs/engine.md says which file owns which step.
"""
