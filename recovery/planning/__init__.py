"""Recovery planning: pure functions, no I/O, that the coordinator runs under its lock.

- ``sources.py``: the same topology — for every rank, the nodes to read its whole committed
  snapshot from, best first;
- ``reshard.py``: a new topology — which box of which held chunk every new rank reads, from
  where (its entry points ``plan`` and ``plan_reads``);
- ``types.py``: the planner's input words (held and wanted chunks);
- ``tables.py``: both sides as tables (a row per rank) for jobs of thousands of ranks;
- ``table_reads.py``: the table path of the planner (numpy);
- ``held.py``: what survived a loss, indexed, and exact covers (the chunk-by-chunk path);
- ``balance.py``: which peer serves each network read;
- ``results.py``: the plan's result (``ReadPlan``);
- ``message.py``: the plan as one compact message per rank (its format and reader are
  ground vocabulary: ``peerckpt/reads.py``).
"""
