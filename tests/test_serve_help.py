"""``kv-sidecar serve --help`` and its refusals: each flag under its one spelling, with its env var
and one default, plain metavars; a bad value named by its flag and env var, in one line."""

from __future__ import annotations

import re

import pytest

from sidecar.cli import main
from sidecar.config import Settings, cli_source, names_of


def serve_help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_every_flag_shows_its_spelling_env_var_and_one_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = serve_help(capsys)
    assert "null" not in text and "{Path" not in text and "SecretStr" not in text
    assert "--kv-sidecar-" not in text  # no flag made of an env var's alias
    actions = {
        a.option_strings[0]: a for a in cli_source().root_parser._actions if a.option_strings
    }
    for field in Settings.model_fields:
        flag, env = names_of(field)
        assert flag in text, flag
        action = actions[flag]
        assert [o for o in action.option_strings if not o.startswith("--no-")] == [flag]
        help_ = str(action.help)
        assert help_.endswith(f"[env: {env}]"), (flag, help_)
        assert help_.count("(default") + help_.count("Unset:") == 1, (flag, help_)
        metavar = action.metavar
        assert metavar is None or re.fullmatch(r"[A-Z]+|\{[a-z0-9,-]+\}|\{N,auto\}", metavar), (
            flag,
            metavar,
        )
    # the default shown is the one the field has, in the spelling a flag takes
    assert "(default: 300) [env: KV_SIDECAR_MAX_QUEUE_WAIT]" in str(
        actions["--max-queue-wait"].help
    )
    assert "(default: adaptive)" in str(actions["--reservation"].help)
    assert "(default: off)" in str(actions["--admin"].help)


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (["--port", "x"], {}, "--port (KV_SIDECAR_PORT): Input should be a valid integer"),
        ([], {"KV_SIDECAR_HEADROOM": "2"}, "--headroom (KV_SIDECAR_HEADROOM): Input should be"),
        (["--model-config", ""], {"KV_SIDECAR_WORKERS": "0"}, "--workers (KV_SIDECAR_WORKERS): "),
        (["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_flag_and_env_var(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    env: dict[str, str],
    said: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"kv-sidecar serve: error: {said}"), err
    assert "model_config_path" not in err and "max_queue" not in err


def test_status_still_has_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["status", "--help"])
    assert exit_.value.code == 0
    assert "URL" in capsys.readouterr().out
