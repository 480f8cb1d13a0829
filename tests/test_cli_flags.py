"""`qwen3vl-encoder serve`: every setting is a flag, generated from `Settings`, shown with its environment variable
and default, and validated exactly as the environment variable is."""

from __future__ import annotations

import subprocess
import sys

import pytest

from service.cli import build_parser
from service.server import settings_from_args
from service.settings import Settings

PUBLIC = [name for name, f in Settings.model_fields.items() if not (f.description or "").startswith("internal:")]


def _serve_parser():
    parser = build_parser()
    return next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith("serve"))


def test_every_setting_is_a_flag_with_its_variable_and_default():
    actions = {a.dest: a for a in _serve_parser()._actions if a.dest != "help"}
    assert sorted(actions) == sorted(PUBLIC)
    for name in PUBLIC:
        action = actions[name]
        assert action.option_strings == [f"--{name.replace('_', '-')}"]
        assert f"QWEN3VL_{name.upper()}" in action.help and "default: " in action.help, name
    help_text = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--help"], capture_output=True, text=True,
                               check=True).stdout
    for name in PUBLIC:
        assert f"--{name.replace('_', '-')}" in help_text, name


@pytest.mark.parametrize("argv,expected", [
    (["--dtype", "auto"], {"dtype": "auto"}),
    (["--http-workers", "3", "--devices", "cpu,cpu"], {"http_workers": 3, "devices": "cpu,cpu"}),
    (["--max-batch-patches", "4096", "--cuda-graphs", "false"], {"max_batch_patches": 4096, "cuda_graphs": False}),
    (["--embedding-cache-mib", "0", "--drain-s", "0.5"], {"embedding_cache_mib": 0, "drain_s": 0.5}),
])
def test_flags_become_settings(argv, expected, monkeypatch):
    monkeypatch.setenv("QWEN3VL_MAX_BATCH_ITEMS", "7")  # the environment still applies where no flag is given
    settings = settings_from_args(build_parser().parse_args(["serve", *argv]))
    for k, v in expected.items():
        assert getattr(settings, k) == v, k
    assert settings.max_batch_items == 7


def test_flags_win_over_the_environment(monkeypatch):
    monkeypatch.setenv("QWEN3VL_PORT", "9001")
    assert settings_from_args(build_parser().parse_args(["serve", "--port", "9002"])).port == 9002
    assert settings_from_args(build_parser().parse_args(["serve"])).port == 9001


@pytest.mark.parametrize("argv,message", [
    (["--max-batch-patches", "10"], "invalid setting max_batch_patches"),
    (["--dtype", "half"], "invalid setting dtype"),
    (["--port", "http"], "invalid setting port"),
])
def test_a_bad_flag_is_refused_like_its_variable(argv, message):
    proc = subprocess.run([sys.executable, "-m", "service.cli", "serve", *argv], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
