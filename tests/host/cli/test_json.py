"""`--json`: exactly one JSON object on stdout for every command that has it; everything else on stderr.

Run through the real `poet` script: a C library writing to file descriptor 1 (HiGHS prints a banner
when it starts) must not reach stdout.
"""

import pytest

from tests.host.cli.helpers import one_json_object, poet


def test_solve_with_the_milp_keeps_the_solver_banner_off_stdout(tmp_path):
    # A gap below what the eviction bound proves of the best baseline (1e-7 here) sends the solve to the MILP.
    result = poet("solve", "--model", "mlp", "--platform", "m4", "--ram-budget", "80%", "--mip-gap", "1e-8", "--json")
    assert result.returncode == 0, result.stderr
    summary = one_json_object(result.stdout)
    assert summary["status"] == "optimal" and summary["recomputes"] + summary["page_outs"] > 0  # the MILP ran
    assert "solving" in result.stderr  # progress went to stderr


@pytest.mark.parametrize("command,argv,key", [
    ("pareto", ["--model", "poet2022:linear", "--platform", "a72", "--points", "2"], "rows"),
    ("train", ["--model", "mlp", "--platform", "a72", "--ram-budget", "80%", "--steps", "2"], "measured"),
    pytest.param("verify", ["--model", "mlp", "--platform", "a72", "--ram-budget", "80%", "--steps", "1"], "ok",
                 marks=pytest.mark.slow),  # ~5 s each: train covers the path fast
    ("profile", ["--local", "--quick"], "page_in_throughput_bytes_per_s"),
    pytest.param("demo", ["--model", "mlp", "--ram-budget", "80%", "--steps", "1"], "solve_status",
                 marks=pytest.mark.slow),
])
def test_every_command_prints_one_json_object(tmp_path, command, argv, key):
    flash = tmp_path / "flash"
    extra = [] if command == "pareto" else ["--flash-dir", str(flash)]
    if command == "profile":
        extra += ["--out", str(tmp_path / "here.profile.json")]
    result = poet(command, *argv, *extra, "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    payload = one_json_object(result.stdout)
    assert key in payload
    if command == "demo":
        assert payload["solve_status"] in ("optimal", "feasible") and payload["platform"] == "local"
