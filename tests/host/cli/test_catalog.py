"""`poet models`, `poet platforms`, `poet profile --local`, and help that states defaults."""

import re

import pytest

from host.cli import build_parser
from host.cli.common import EXIT_OK
from tests.host.cli.helpers import poet, run_main


def test_models_and_platforms_list(capfd):
    code, out, _ = run_main(capfd, "models")
    assert code == EXIT_OK and "resnet18_cifar" in out and "poet2022:bert" in out
    code, out, _ = run_main(capfd, "platforms")
    assert code == EXIT_OK and "a72nocache" in out and "m0" in out


def test_profile_local_writes_a_loadable_profile_and_leaves_flash_clean(capfd, tmp_path):
    from host.costs import load_profile

    flash = tmp_path / "flash"
    flash.mkdir()
    out = tmp_path / "here.profile.json"
    code, stdout, err = run_main(capfd, "profile", "--local", "--quick", "--flash-dir", str(flash), "--out", str(out))
    assert code == EXIT_OK, err
    assert f"wrote {out}" in stdout
    profile = load_profile(str(out))
    assert profile.page_in_throughput_bytes_per_s > 0 and profile.flops_per_s["default"] > 0
    assert profile.energy_source.startswith("modelled:")
    assert list(flash.iterdir()) == []
    code, _, err = run_main(capfd, "solve", "--model", "mlp", "--platform", str(out), "--ram-budget", "80%")
    assert code == EXIT_OK, err


def test_profile_creates_a_missing_flash_dir_and_says_so(capfd, tmp_path):
    flash = tmp_path / "new" / "flash"
    code, _, err = run_main(capfd, "profile", "--local", "--quick", "--flash-dir", str(flash),
                            "--out", str(tmp_path / "p.json"))
    assert code == EXIT_OK, err
    assert f"created flash dir {flash}" in err and flash.is_dir()


def _options(parser):
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, command in sub.choices.items():
        for action in command._actions:
            if action.option_strings and action.dest != "help":
                yield name, action


@pytest.mark.parametrize("command,action", list(_options(build_parser())),
                         ids=[f"{c} {a.option_strings[-1]}" for c, a in _options(build_parser())])
def test_every_option_has_help_that_states_its_default(command, action):
    assert action.help, f"poet {command} {action.option_strings[-1]} has no help"
    if action.required or action.nargs == 0:  # required flags and switches have no default to state
        return
    assert "default" in action.help, f"poet {command} {action.option_strings[-1]}: help does not state its default"


def test_ram_budget_help_says_what_a_share_is_of_and_allocator_names_its_default():
    text = " ".join(poet("train", "--help").stdout.split())
    assert re.search(r"percentage of the no-remat peak, the controlled RAM plain training needs", text)
    assert "default: keep" in text


def test_the_console_script_and_python_m_agree():
    import subprocess
    import sys

    from tests.host.cli.helpers import test_env

    module = subprocess.run([sys.executable, "-m", "host.cli", "platforms"], capture_output=True, text=True,
                            env=test_env())
    assert module.returncode == 0 and module.stdout == poet("platforms").stdout


def test_parsing_the_command_line_does_not_load_torch():
    """`poet --help` and a bad flag answer at once: torch loads only when a command runs (it takes seconds)."""
    import subprocess
    import sys

    probe = ("import sys; from host.cli import build_parser; build_parser().parse_args(['solve', '--model', 'mlp', "
             "'--platform', 'a72', '--ram-budget', '50%']); loaded = sorted(m for m in ('torch', 'device_agent.executor') "
             "if m in sys.modules); print(','.join(loaded) or 'none')")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "none"
