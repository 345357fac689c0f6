"""The launcher process and the command line: one ``Launcher`` interface (``base.py``), its
backends, the observers of a running job and the ``peerckpt`` command (``cli.py``).

Layer: top (the folder ``launch/``, imported as ``peerckpt.launch``). It may import anything
but chaos internals: it starts processes of every kind, so it knows all their packages; of
``chaos/`` it uses only the package's public surface (``peerckpt.chaos``: ``Chaos``, which it
runs beside a job when asked, and what the campaign draws faults with). Nothing below it
imports or names it: under plain torchrun the rank's package finds the host supervisor's
module through the ``peerckpt.processes`` entry point.

- ``cli.py``: the ``peerckpt`` command (``python -m peerckpt.launch`` runs it too);
- ``campaign.py``: the seeded chaos campaign (``peerckpt chaos``);
- ``torchrun.py``: the host supervisor under plain torchrun;
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
