"""The rank process: the user's training script with peerckpt inside it.

Layer: process (the rank). It may import the ground vocabulary (``peerckpt/``) and the
durable library (``persist/``), never the agent's or the coordinator's packages, nor
``chaos/``: it talks to its node's agent only, through typed messages over its control link.

Here: the decorator and ``Context`` (``api.py``), the epoch loop and its state machine
(``rank.py``, ``state.py``), capture and restore of the tracked state, the snapshot copy
engine, the process group's lifecycle, DDP bucket layouts, the resumable sampler.
"""
