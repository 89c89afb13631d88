"""Each replaying algorithm's draw from the replay store, one module each: RLEP's uniform
draw of a question's answers (`rlep`), ExGRPO's bucketed draw of questions (`exgrpo`),
answer-level replay's race by priority (`prioritized`).

A draw has two halves: a function the store runs on each shard, where the answers are
(`ReplayStore.draw`, `ReplayShard.draw`: only what it picks moves), and the client's
function that asks the shards and joins their parts. The shard half is sent by reference,
so these modules import only numpy and `rayrep.buffer`: a shard that loads one does not
load torch."""
