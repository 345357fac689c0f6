"""Starting a job: one ``Launcher`` interface (``base.py``) and its backends.

Layer: top. It may import anything but chaos internals: it starts processes of every kind,
so it knows all their packages; of ``chaos/`` it uses only the package's public surface
(``peerckpt.chaos.Chaos``), which it runs beside a job when asked.

- ``base.py``: ``Launcher``, ``JobSpec``, ``JobResult``; ``checks.py`` every rule a job's
  settings must meet, checked before anything starts (by the launchers and the CLI alike);
- ``local.py``: ``peerckpt run`` on this machine, every node a simulated failure domain;
- ``processes.py``: starting and stopping agents and training processes on this machine;
- ``host.py``: one host of a multi-host job (``peerckpt run --nnodes``);
- ``ray.py``: ``peerckpt run --ray``, a job on a Ray cluster: the driver; ``rayactor.py`` the
  actor it pins to each Ray node, ``rayhost.py`` the host launcher that actor starts,
  ``rayplan.py`` the pure rules (host order, where each fault goes), ``rayenv.py`` what of
  the launching environment the hosts get;
- ``join.py``: ``peerckpt join``, one more node for a running job;
- ``report.py``: the report of a finished job;
- ``view.py``: one view of a running job, from the coordinator's ``Status``, that every
  observer shows; ``monitor.py`` keeps it in a launcher and serves it over HTTP as
  ``metrics.py`` (Prometheus) and ``statuspage.py`` (HTML); ``console.py`` is
  ``peerckpt status``; ``timeline.py`` draws a job's report; ``progress.py`` reports long
  commands.
"""
