"""The coordinator process: one per job, the single source of truth about membership.

Layer: process (the coordinator). It may import the ground vocabulary (``peerckpt/``) and the
durable library (``persist/``), never the rank's or the agent's packages, nor ``chaos/``.
It talks to agents only, over gRPC, in typed messages.

Here: membership and epochs, failure detection, the commit tracker, buddy placement, durable
flush scheduling, and the pure planning it runs (``planning/``: where every rank of a new
epoch reads its state).
"""
