"""@resilient's options: one set of defaults, bad values refused when the script decorates."""

from __future__ import annotations

import inspect

import pytest

from peerckpt.errors import ConfigurationError
from peerckpt.runtime.api import resilient
from peerckpt.runtime.config import DEFAULTS, ResilientConfig


def test_resilient_keywords_are_the_config_fields_with_the_config_defaults() -> None:
    params = {
        name: p.default
        for name, p in inspect.signature(resilient).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    fields = {name: getattr(DEFAULTS, name) for name in ResilientConfig.__dataclass_fields__}
    assert params == fields


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"persist_every": 10}, "need persist=URL"),
        ({"replicas": -1}, "replicas must be 0 or more"),
        ({"suspect_s": 0}, "suspect_s must be positive"),
        ({"abort_timeout_s": -5.0}, "abort_timeout_s must be positive"),
        ({"every": 0}, "every=0"),
        ({"overhead": 1.5}, "fraction of the step time"),
        ({"mtbf": 0.0}, "mean time between failures"),
    ],
)
def test_a_bad_option_fails_at_decoration_time(options: dict, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        resilient(**options)


def test_the_persist_settings_travel_as_the_agent_reads_them(tmp_path) -> None:
    config = ResilientConfig(persist=str(tmp_path), persist_every=7, keep=2)
    msg = config.persist_msg()
    assert msg is not None and msg["every"] == 7 and msg["keep"] == 2
    assert ResilientConfig().persist_msg() is None
