"""The agent process: one per node, owning the node's memory and its data links.

Layer: process (the agent). It may import the ground vocabulary (``peerckpt/``) and the
durable library (``persist/``), never the rank's or the coordinator's packages, nor
``chaos/``. It never imports torch, so it starts in a fraction of a second.

Here: the shared-memory arena and its slots, the control link to local ranks, the data
server and the transfers between agents (push, fetch, gather), checksums, replication to
buddies, the agent's side of a recovery, and its share of durable flushes.
"""
