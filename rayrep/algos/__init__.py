"""The algorithms: GRPO (`grpo`), RLEP (`rlep`), ExGRPO (`exgrpo`), answer-level prioritized
replay (`prioritized`), their shared interface (`interface`) and their registry
(`registry`), the one place that maps `algorithm.name` to code. Each replaying algorithm's
draw from the replay store lives in `sampling`, which the store's shards run where the
answers are: this package imports nothing itself, so that a shard that unpickles a draw
loads only the draw's module, not torch."""
