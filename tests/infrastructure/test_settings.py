"""The [deploy] table: defaults, validation with clear messages, and the example run file."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from infra.settings import DeploySettings, FunctionSettings, load_deploy, stack_name_for
from shared.config import ConfigError, RunConfig

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_example_run_file_deploys_as_fed_example() -> None:
    # Given the example run file `make synth` uses
    config, settings = load_deploy(REPO / "runs" / "example.toml")
    # Then it names its run and deploys as fed-<run_id>
    assert config.run_id == "example"
    assert stack_name_for(config, settings) == "fed-example"
    assert stack_name_for(config, settings, "Other-Name") == "Other-Name"


def test_a_run_file_without_deploy_table_uses_the_defaults(tmp_path: Path) -> None:
    # Given a run file with only the run's keys at top level
    config, settings = load_deploy(write(tmp_path, 'run_id = "plain"\n'))
    # Then the deploy settings are the defaults: data kept, protected, logs for a month
    assert config.run_id == "plain"
    assert settings == DeploySettings()
    assert settings.retain_data and settings.table_deletion_protection and settings.log_retention_days == 30


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[run]\nrun_id = "r1x"\n[deploy]\nlog_retention_days = 10\n', "deploy.log_retention_days"),
        ('[run]\nrun_id = "r1x"\n[deploy]\nbogus = 1\n', "deploy.bogus"),
        ('[run]\nrun_id = "r1x"\n[deploy.tick]\nmemory_mb = 64\n', "deploy.tick.memory_mb"),
        ('[run]\nrun_id = "r1x"\n[deploy]\nstack_name = "1bad_name"\n', "deploy.stack_name"),
        ('[run]\nrun_id = "r1x"\n[deploy]\nparticipant_principals = ["role/x"]\n', "deploy.participant_principals"),
        ('run_id = "r1x"\n[deploy]\nretain_data = false\n', "under [run]"),
        # fewer than Lambda's five receives: a throttled Lambda's hand-backs alone could dead-letter a message
        ('[run]\nrun_id = "r1x"\n[deploy]\nshard_max_receives = 3\n', "deploy.shard_max_receives"),
        ('[run]\nrun_id = "r1x"\n[deploy]\njoin_max_receives = 4\n', "deploy.join_max_receives"),
    ],
)
def test_bad_deploy_settings_are_refused_naming_the_field(tmp_path: Path, text: str, message: str) -> None:
    # Given a run file with one bad [deploy] setting
    path = write(tmp_path, text)
    # When it is loaded, Then the error names the field
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("[", r"\[").replace("]", r"\]")):
        load_deploy(path)


def test_stuck_window_is_whole_minutes_between_one_minute_and_one_day() -> None:
    # Given round deadlines short and long
    short = RunConfig(run_id="abc", max_round_train_time=5)
    usual = RunConfig(run_id="abc", max_round_train_time=100)
    long = RunConfig(run_id="abc", max_round_train_time=60_000)
    settings = DeploySettings(stuck_round_multiple=3)
    # Then the alarm window is the multiple rounded up to minutes, within CloudWatch's bounds
    assert settings.stuck_window_seconds(short) == 60
    assert settings.stuck_window_seconds(usual) == 300
    assert settings.stuck_window_seconds(long) == 86400


def test_the_shard_worker_and_the_ticks_have_their_own_defaults() -> None:
    # Given the defaults
    settings = DeploySettings()
    # Then the shard worker has one full vCPU (1769 MB), Lambda's longest timeout, and concurrency of its own for
    # as many workers as its queue runs at once; the tick has its own too, and ingest is capped: no flood of ingest
    # invocations can throttle an aggregation or a tick
    assert settings.shard.memory_mb == 1769 and settings.shard.timeout_seconds == 900
    assert settings.shard.reserved_concurrency == settings.shard_concurrency == 64
    assert settings.tick.reserved_concurrency == 5 and settings.ingest.reserved_concurrency == 200
    with pytest.raises(ValidationError, match="below shard_concurrency"):
        DeploySettings(shard_concurrency=128)
    assert DeploySettings(shard_concurrency=128, shard=FunctionSettings(reserved_concurrency=128))
    # And both functions that tick (and so may wait for an aggregation's shards) may run as long
    assert settings.tick.timeout_seconds == settings.ingest.timeout_seconds == 900
    # And the queues the shard and join functions drain redeliver as Lambda advises for a queue event source: six
    # function timeouts of visibility, five receives before the dead-letter queue; the shard queue keeps a task until
    # then (90 minutes apart: 9 hours), far beyond the 870 s a tick waits for its shards
    assert settings.shard.queue_visibility_seconds == 5400 and settings.join.queue_visibility_seconds == 360
    assert settings.shard_max_receives == settings.join_max_receives == 5
    assert settings.shard_retention_seconds() == 6 * 5400
    assert DeploySettings(shard=FunctionSettings(timeout_seconds=10)).shard_retention_seconds() == 2 * 3600
    assert DeploySettings(shard_max_receives=1000).shard_retention_seconds() == 4 * 86400


def test_a_function_table_overrides_only_the_keys_it_names(tmp_path: Path) -> None:
    # Given a run file that sets only the memory of the shard worker and of the join function
    path = write(tmp_path, '[run]\nrun_id = "r1x"\n[deploy.shard]\nmemory_mb = 3008\n[deploy.join]\nmemory_mb = 1024\n')
    # When it is loaded
    _, settings = load_deploy(path)
    # Then their other keys keep each function's own defaults, not the generic ones
    assert settings.shard.memory_mb == 3008 and settings.shard.timeout_seconds == 900
    assert settings.shard.ephemeral_storage_mb == DeploySettings().shard.ephemeral_storage_mb
    assert settings.join.memory_mb == 1024 and settings.join.timeout_seconds == 60
    # And a key no function has is still refused, naming it
    with pytest.raises(ConfigError, match=r"deploy\.shard\.bogus"):
        load_deploy(write(tmp_path, '[run]\nrun_id = "r1x"\n[deploy.shard]\nbogus = 1\n'))
