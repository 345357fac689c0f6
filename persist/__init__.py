"""The durable tier: the checkpoint format and store, read and written through fsspec.

Layer: library. It may import the ground vocabulary (``peerckpt/``) only. The agents write
through it, the coordinator schedules and commits through it, the ranks and the CLI read
through it.

Here: ``config.py`` (where and how often), ``durable.py`` (the store: writers, commit,
finding steps, retention), ``format.py`` (the records, decoded as untrusted input),
``checkpoint.py`` (reading a committed step), ``localfs.py`` (local files opened safely),
``direct.py`` (O_DIRECT data files), ``interop.py`` (safetensors, the
``torch.distributed.checkpoint`` reader), ``inspect.py`` (``peerckpt inspect``).
"""
