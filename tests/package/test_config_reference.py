"""docs/config.md's reference: generated from base_config's source, and current."""

import importlib.util
import inspect
import pathlib
import textwrap

import cli_runs
import pytest

from mixloop import config as config_module
from mixloop import config_reference
from mixloop.config import base_config
from mixloop.config_reference import REFERENCE_END, REFERENCE_START, key_comments, markdown_reference

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / config_reference.REFERENCE_FILE
REGENERATE = "python -m mixloop.config_reference --write"


def documented_reference(text):
    """What docs/config.md holds between the markers, as the generator prints it."""
    start = text.index(REFERENCE_START) + len(REFERENCE_START)
    return text[start:text.index(REFERENCE_END)].strip() + "\n"


def all_keys(config, prefix=""):
    for key, value in config.items():
        if hasattr(value, "items") and key not in config_module.FREE_FORM_SECTIONS:
            yield from all_keys(value, prefix + key + ".")
        else:
            yield prefix + key


def test_the_docs_table_is_the_generators_output():
    assert documented_reference(DOCS.read_text()) == markdown_reference(), (
        f"{DOCS.relative_to(ROOT)} is out of date with base_config(); regenerate it from the "
        f"repository's root: {REGENERATE}")


def test_every_key_has_a_row_with_its_default_and_a_comment():
    table = documented_reference(DOCS.read_text())
    comments = key_comments()
    keys = list(all_keys(base_config()))
    assert len(keys) > 40
    for key in keys:
        free_form = key in config_module.FREE_FORM_SECTIONS
        default = "{} (free-form)" if free_form else repr(base_config()[key])
        assert f"| `{key}` | `{default}` | " in table, key
        assert comments[key], f"config.{key} has no comment in base_config()"


def test_comments_come_from_beside_and_above_the_assignment():
    comments = key_comments()
    assert comments["seed"] == "Seeds Python, NumPy, TensorFlow and Keras."
    assert comments["precision.overflow_retries"].startswith("Dynamic scale: a step whose updates")
    assert comments["precision.overflow_retries"].endswith("; 0 skips at once.")
    assert "\n" not in comments["precision.overflow_retries"]
    # A pipe in a comment is escaped, or it would split the table's cell.
    assert '"auto\\|REGEX"' in markdown_reference()
    # The sections, in the order base_config() makes them.
    headings = [line for line in markdown_reference().splitlines() if line.startswith("### ")]
    assert headings == ["### Top level", "### `precision`", "### `train`", "### `optimizer`",
                        "### `eval`", "### `checkpoint`"]


def _base_config_with_extra_key(tmp_path, added_lines):
    """A module whose base_config() is mixloop's with `added_lines` before its return."""
    source = inspect.getsource(base_config).replace(
        "    return config\n", textwrap.indent(added_lines, "    ") + "    return config\n")
    path = tmp_path / "extended_config.py"
    path.write_text("import ml_collections\n"
                    "from ml_collections.config_dict import FieldReference\n"
                    "from mixloop.config import AUTO\n\n" + source)
    spec = importlib.util.spec_from_file_location("extended_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.base_config


def test_a_key_added_without_regenerating_changes_the_table(tmp_path):
    extended = _base_config_with_extra_key(
        tmp_path, "# A key nobody documented yet,\nconfig.train.extra_key = 7  # on two lines.\n")
    reference = markdown_reference(extended)
    assert reference != markdown_reference()
    assert "| `train.extra_key` | `7` | A key nobody documented yet, on two lines. |" in reference
    assert documented_reference(DOCS.read_text()) != reference


def test_a_key_set_other_than_by_assignment_is_refused(tmp_path):
    extended = _base_config_with_extra_key(tmp_path, "config.train.update(hidden=1)\n")
    with pytest.raises(ValueError, match="train.hidden other than by `config.KEY = VALUE`"):
        markdown_reference(extended)


def test_write_fills_the_block_between_the_markers():
    text = f"intro\n\n{REFERENCE_START}\nstale\n{REFERENCE_END}\nafter\n"
    assert config_reference.with_reference(text, "| new |\n") == (
        f"intro\n\n{REFERENCE_START}\n\n| new |\n\n{REFERENCE_END}\nafter\n")
    with pytest.raises(ValueError, match="no <!-- generated"):
        config_reference.with_reference("no markers\n", "| new |\n")


@pytest.mark.slow
def test_the_command_prints_the_reference():
    result = cli_runs.run("mixloop.config_reference", cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout == markdown_reference()
