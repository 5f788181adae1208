"""generated/ is checked in: it must be exactly what the templates and the matrix render."""
from pathlib import Path

from click.testing import CliRunner

from flashgen.cli import cli

REPO = Path(__file__).resolve().parent.parent


def test_generated_folder_has_not_drifted():
    result = CliRunner().invoke(cli, ["emit", "--out", str(REPO / "generated"), "--check"])
    assert result.exit_code == 0, f"generated/ drifted; run `flashgen emit`:\n{result.output}"
