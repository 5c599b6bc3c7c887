"""The connector's settings table (``connector.config.SETTINGS``): each setting's environment
variable and flag reach ``ConnectorConfig``, our launcher's parser, its ``--help`` and the SGLang
plugin's reading of what SGLang parsed, all alike."""

from __future__ import annotations

import argparse
import re
from types import SimpleNamespace

import pytest

from connector.config import ENV_NAMES, SETTINGS, ConnectorConfig, Setting
from sglang_ext import plugin
from sglang_ext.args import ENCODE_BOOTSTRAP_PORT, add_worker_args, connector_config, shared_flags

pytestmark = pytest.mark.fast

MODE = ("--disaggregation-mode", "encode")


def other_value(s: Setting, step: int = 1) -> object:
    """A valid value of ``s`` that is not its default (``step`` picks another one)."""
    if s.choices:
        return [c for c in s.choices if c != s.default][step - 1]
    if s.name == "control_secret":
        return f"secret-{step}-" + "s" * 16
    if s.name in ("host", "advertise_host"):
        return f"127.0.0.{1 + step}"
    if s.name == "ib_device":
        return f"mlx5_{step}"
    return s.type(s.default * (1 + step) if s.default else step)


def launcher_args(argv: tuple[str, ...] = ()) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_worker_args(parser)
    return parser.parse_args([*MODE, *argv])


def flag_argv(values: dict[str, object]) -> tuple[str, ...]:
    return tuple(x for s in SETTINGS if s.flag and s.name in values for x in (s.flag, str(values[s.name])))


def help_of(text: str, flag: str) -> str:
    """The help entry of ``flag`` in ``--help`` output, whitespace collapsed."""
    lines = text.splitlines()
    start = next(i for i, x in enumerate(lines) if re.match(rf"  {re.escape(flag)}\b", x))
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"  -|\S", lines[i])), len(lines))
    return " ".join(" ".join(lines[start:end]).split())


def test_the_table_keeps_every_name_and_default() -> None:
    assert {s.name: (s.env, s.flag, s.default) for s in SETTINGS} == {
        "host": (None, "--host", "127.0.0.1"),
        "advertise_host": ("SGLANG_EMBEDDING_ADVERTISE_HOST", "--advertise-host", ""),
        "block_size": ("SGLANG_MULTIMODAL_BLOCK_SIZE", "--multimodal-block-size", 128),
        "num_blocks": ("SGLANG_EMBEDDING_CACHE_BUFFER_SIZE", "--embedding-cache-buffer-size", 512),
        "default_allocate_tokens": ("SGLANG_EMBEDDING_DEFAULT_ALLOCATE_BUFFER_SIZE",
                                    "--embedding-default-allocate-buffer-size", 8192),
        "protocol": ("MOONCAKE_PROTOCOL", "--mooncake-protocol", "tcp"),
        "ib_device": (None, "--disaggregation-ib-device", ""),
        "bootstrap_timeout": ("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "--bootstrap-timeout", 300.0),
        "waiting_timeout": ("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "--waiting-timeout", 300.0),
        "join_timeout": ("SGLANG_EMBEDDING_JOIN_TIMEOUT", "--join-timeout", 15.0),
        "resume_timeout": ("SGLANG_EMBEDDING_RESUME_TIMEOUT", "--resume-timeout", 300.0),
        "heartbeat_interval": ("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", "--heartbeat-interval", 5.0),
        "heartbeat_max_failures": ("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", "--heartbeat-max-failure", 2),
        "abort_ack_timeout": ("SGLANG_EMBEDDING_ABORT_ACK_TIMEOUT", "--abort-ack-timeout", 15.0),
        "unacked_block_hold": ("SGLANG_EMBEDDING_UNACKED_BLOCK_HOLD", "--unacked-block-hold", 0.0),
        "min_link_rate": ("SGLANG_EMBEDDING_MIN_LINK_RATE", "--min-link-rate", 50e6),
        "transfer_workers": ("SGLANG_EMBEDDING_TRANSFER_WORKERS", None, 2),
        "max_sleep": ("SGLANG_EMBEDDING_MAX_SLEEP", "--max-sleep", 3600.0),
        "staging_bytes": ("SGLANG_EMBEDDING_STAGING_BYTES", "--staging-bytes", 4 << 30),
        "max_queued_requests": ("SGLANG_EMBEDDING_MAX_QUEUED_REQUESTS", "--max-queued-requests", 256),
        "queue_timeout": ("SGLANG_EMBEDDING_QUEUE_TIMEOUT", "--queue-timeout", 60.0),
        "fork_abort_hold": ("SGLANG_EMBEDDING_FORK_ABORT_HOLD", "--fork-abort-hold", 300.0),
        "control_secret": ("SGLANG_EMBEDDING_CONTROL_SECRET", "--control-secret", ""),
    }
    assert ENV_NAMES == {s.name: s.env for s in SETTINGS if s.env}
    config = ConnectorConfig()
    assert all(getattr(config, s.name) == s.default for s in SETTINGS)


@pytest.mark.parametrize("s", [s for s in SETTINGS if s.env], ids=lambda s: s.env)
def test_each_env_var_reaches_the_config_the_parser_and_help(monkeypatch, s: Setting) -> None:
    value = other_value(s)
    monkeypatch.setenv(s.env, str(value))
    assert getattr(ConnectorConfig.from_env(), s.name) == value
    args = launcher_args()
    assert getattr(connector_config(args), s.name) == value
    if s.flag is None:
        return
    assert getattr(args, s.dest) == value
    parser = argparse.ArgumentParser()
    add_worker_args(parser)
    entry = help_of(parser.format_help(), s.flag)
    assert f"env {s.env} (default " in entry
    if s.name != "control_secret":  # the secret itself is never shown
        assert f"(default {value}" in entry, entry
    else:
        assert str(value) not in entry and "(default set by the environment)" in entry


@pytest.mark.parametrize("s", [s for s in SETTINGS if s.flag], ids=lambda s: s.flag)
def test_a_flag_overrides_the_env(monkeypatch, s: Setting) -> None:
    if s.env:
        monkeypatch.setenv(s.env, str(other_value(s)))
    flag_value = other_value(s, 2) if s.choices is None or len(s.choices) > 2 else s.default
    args = launcher_args((s.flag, str(flag_value)))
    assert getattr(args, s.dest) == flag_value
    assert getattr(connector_config(args), s.name) == flag_value


def test_help_lists_each_flag_with_its_env_var_and_default(monkeypatch) -> None:
    for s in SETTINGS:
        if s.env:
            monkeypatch.delenv(s.env, raising=False)
    parser = argparse.ArgumentParser()
    add_worker_args(parser)
    text = parser.format_help()
    for s in SETTINGS:
        if s.flag is None:  # an environment-only setting: listed in its own section
            section = " ".join(text.split("given by environment variable only:")[1].split())
            assert f"{s.env}: {s.help} (default {s.default})" in section
            continue
        entry = help_of(text, s.flag)
        assert s.help.split(" ")[0] in entry
        assert (f", env {s.env} (default " in entry) == (s.env is not None), entry
        shown = s.shown(ConnectorConfig()) if s.shown else str(s.default)
        assert f"(default {shown})" in entry, entry
    assert "(default 512 = 449 MiB at hidden 3584 bfloat16)" in help_of(text, "--embedding-cache-buffer-size")
    assert "(default 4294967296 = 4 GiB)" in help_of(text, "--staging-bytes")
    assert "(default off)" in help_of(text, "--control-secret")


def test_an_invalid_env_value_names_its_variable(monkeypatch) -> None:
    monkeypatch.setenv("SGLANG_EMBEDDING_QUEUE_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="SGLANG_EMBEDDING_QUEUE_TIMEOUT='soon' is not a valid float"):
        ConnectorConfig.from_env()
    monkeypatch.setenv("SGLANG_EMBEDDING_QUEUE_TIMEOUT", "0")
    with pytest.raises(ValueError, match="queue_timeout must be a positive number of seconds"):
        ConnectorConfig.from_env()


def test_shared_flags_are_the_table_rows_sglang_defines_too() -> None:
    table = {s.flag for s in SETTINGS if s.sglang}
    assert table == {"--host", "--disaggregation-ib-device", "--max-queued-requests"}
    shared = {f.flag for f in shared_flags()}
    assert table <= shared
    ours = argparse.ArgumentParser(add_help=False)
    add_worker_args(ours, with_shared=False)  # what the plugin adds to SGLang's parser
    assert not {o for a in ours._actions for o in a.option_strings} & shared


def sglang_parsed(**given: object) -> SimpleNamespace:
    """What SGLang's parser gives the plugin for the shared flags: unset ones as SGLang leaves them."""
    values: dict[str, object] = {f.dest: None for f in shared_flags()}
    values |= {"disaggregation_mode": "encode", "encoder_only": False, "language_only": False,
               "disaggregation_transfer_backend": "mooncake", "host": "127.0.0.1", "port": 30000, "tp_size": 1,
               "log_level": "info", "disaggregation_bootstrap_port": 8998}
    return SimpleNamespace(**(values | given))


def test_the_plugin_reads_the_same_values_as_our_launcher(monkeypatch) -> None:
    """Every setting given by its environment variable, some by flags: the plugin's worker
    (SGLang's parsed values for the shared flags, ours from argv) gets the launcher's config."""
    env = {s.name: other_value(s) for s in SETTINGS if s.env}
    for s in SETTINGS:
        if s.env:
            monkeypatch.setenv(s.env, str(env[s.name]))
    flags = {"block_size": 32, "resume_timeout": 7.5, "max_queued_requests": 12, "host": "127.0.0.9",
             "ib_device": "mlx5_9"}
    argv = (*MODE, *flag_argv(flags))
    launcher = connector_config(launcher_args(flag_argv(flags)))
    shared = {s.dest: flags[s.name] for s in SETTINGS if s.sglang and s.name in flags}
    ours = plugin.worker_args(sglang_parsed(**shared), list(argv))
    via_plugin = connector_config(ours)
    assert via_plugin == launcher
    assert {s.name: getattr(via_plugin, s.name) for s in SETTINGS} == env | flags
    # SGLang left --max-queued-requests unset: the environment's value, then the default
    ours = plugin.worker_args(sglang_parsed(), [*MODE])
    assert connector_config(ours).max_queued_requests == env["max_queued_requests"]
    monkeypatch.delenv("SGLANG_EMBEDDING_MAX_QUEUED_REQUESTS")
    ours = plugin.worker_args(sglang_parsed(), [*MODE])
    assert connector_config(ours).max_queued_requests == 256


def test_an_encoders_bootstrap_port_is_none_of_sglangs_defaults() -> None:
    """Unless told, an encode worker's bootstrap server takes 8996, not SGLang's 8998 (its PD
    prefill's KV bootstrap) or 8997 (its own encoder's): the plugin and our launcher alike."""
    assert plugin.worker_args(sglang_parsed(), [*MODE]).disaggregation_bootstrap_port == ENCODE_BOOTSTRAP_PORT == 8996
    assert launcher_args().disaggregation_bootstrap_port == ENCODE_BOOTSTRAP_PORT
    given = plugin.worker_args(sglang_parsed(disaggregation_bootstrap_port=8998),
                               [*MODE, "--disaggregation-bootstrap-port", "8998"])
    assert given.disaggregation_bootstrap_port == 8998


@pytest.mark.parametrize(("name", "value"), [("SGLANG_EMBEDDING_CONTROL_SECRET", "abcdefghijklm"),
                                             ("SGLANG_MULTIMODAL_BLOCK_SIZE", "many")])
def test_a_wrong_setting_in_the_environment_is_a_one_line_error(monkeypatch, capsys, name, value) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as ended:
        add_worker_args(argparse.ArgumentParser(prog="launch"))
    assert ended.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("launch: error: from the environment: ") and "Traceback" not in error, error
