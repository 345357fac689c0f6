"""What of the launching shell's environment a ``--ray`` job's processes get
(``launch/rayenv.py``); the job on a real Ray cluster is in tests/test_ray.py."""

from __future__ import annotations

from peerckpt.launch.rayenv import forwarded, is_forwarded


def test_the_jobs_own_variables_are_forwarded_and_the_machines_are_not() -> None:
    shell = {
        # the job's: forwarded, whatever they are
        "NCCL_DEBUG": "INFO",
        "HF_TOKEN": "hf_x",
        "PYTHONPATH": "/src",
        "OMP_NUM_THREADS": "4",
        "LANG": "C.UTF-8",
        "PEERCKPT_LOG_LEVEL": "INFO",
        "MY_SETTING": "a=b c",
        # the launching machine's, session's, user's, scratch, devices, installation
        "HOSTNAME": "laptop",
        "PWD": "/home/me/project",
        "SSH_AUTH_SOCK": "/tmp/ssh-x/agent.1",
        "SSH_CONNECTION": "10.0.0.1 22 10.0.0.2 5000",
        "DISPLAY": ":0",
        "XDG_RUNTIME_DIR": "/run/user/1000",
        "HOME": "/home/me",
        "USER": "me",
        "TMPDIR": "/var/folders/x",
        "CUDA_VISIBLE_DEVICES": "0",
        "ROCR_VISIBLE_DEVICES": "1",
        "PATH": "/home/me/.venv/bin:/usr/bin",
        "VIRTUAL_ENV": "/home/me/.venv",
        "CONDA_PREFIX": "/opt/conda",
        # Ray's and peerckpt's plumbing
        "RAY_ADDRESS": "auto",
        "PEERCKPT_SECRET": "00" * 32,
        "PEERCKPT_SECRET_FILE": "/home/me/.secret",
        "PEERCKPT_NODE_ADDR": "10.0.0.2",
        "PEERCKPT_RAY_ACTOR_PID": "123",
        "RANK": "0",
        "WORLD_SIZE": "4",
    }
    assert forwarded(shell) == {
        "NCCL_DEBUG": "INFO",
        "HF_TOKEN": "hf_x",
        "PYTHONPATH": "/src",
        "OMP_NUM_THREADS": "4",
        "LANG": "C.UTF-8",
        "PEERCKPT_LOG_LEVEL": "INFO",
        "MY_SETTING": "a=b c",
    }


def test_only_whole_names_and_their_families_are_dropped() -> None:
    # A name that merely contains a dropped one is the job's.
    for name in ("MY_HOME", "HOMEBREW_PREFIX", "USERNAME_HINT", "PATHS", "XRAY_", "TMPDIR2"):
        assert is_forwarded(name), name
    for name in ("SSH_TTY", "XDG_SESSION_ID", "CONDA_DEFAULT_ENV", "RAY_DEDUP_LOGS"):
        assert not is_forwarded(name), name
