"""The README stays true: it opens with the two set-up commands and documents every config key."""
from __future__ import annotations

import re

from conftest import REPO

from phalanx.core.config import describe_markdown


def readme() -> str:
    return (REPO / "README.md").read_text()


def test_readme_opens_with_the_two_setup_commands():
    block = re.search(r"```bash\n(.*?)```", readme(), re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_readme_config_table_is_generated_from_the_schema():
    text = readme()
    start = text.index("<!-- CONFIG-KEYS -->") + len("<!-- CONFIG-KEYS -->\n")
    end = text.index("<!-- /CONFIG-KEYS -->")
    assert text[start:end].strip() == "\n".join(describe_markdown()).strip(), \
        "README config table is stale: regenerate with `phalanx config --show --markdown`"
