"""Checkpoints that never lie.

A tier (`tier.CheckpointTier`) owns one place checkpoints live and one format; `loader` picks among
the candidates of all tiers, verifying before it trusts and agreeing across ranks; `manager` is the
handful of calls the training loop makes. `atomic`, `layout`, `tracker` and `manifest` are the
crash-safety primitives every tier shares.
"""
