"""README's table "Defaults of optimizers and initializers" states every parameter of every
optimizer and initializer with the default its dataclass really has, so the document
cannot drift from wehub_ps/specs.py."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from wehub_ps.specs import INITIALIZER_KINDS, OPTIMIZER_KINDS, Explicit

README = Path(__file__).resolve().parents[3] / "README.md"
HEADING = "### Defaults of optimizers and initializers"
NO_PARAMETER = "—"

#: Explicit is no user's choice: passing an array makes it, its only field is the array's hash.
DOCUMENTED_CLASSES = [cls for cls in [*OPTIMIZER_KINDS, *INITIALIZER_KINDS] if cls is not Explicit]


def _code(cell: str) -> str:
    """The first `code span` of a table cell, or the cell itself when it has none."""
    parts = cell.split("`")
    return parts[1] if len(parts) >= 3 else cell.strip()


def defaults_table(text: str) -> list[tuple[str, str, str]]:
    """(class, parameter, default cell) for each row of the table under HEADING."""
    lines = text.splitlines()
    start = lines.index(HEADING)
    rows, in_table = [], False
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        if not line.startswith("|"):
            if in_table:
                break
            continue
        in_table = True
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "class" or set(cells[0]) <= {"-", " "}:
            continue
        rows.append((_code(cells[0]), _code(cells[1]), cells[2]))
    return rows


def table_problems(text: str) -> list[str]:
    """Every way the README's table disagrees with the dataclasses."""
    problems = []
    stated: dict[tuple[str, str], str] = {}
    for cls_name, parameter, default in defaults_table(text):
        if (cls_name, parameter) in stated:
            problems.append(f"{cls_name}.{parameter} appears twice")
        stated[(cls_name, parameter)] = default
    expected: set[tuple[str, str]] = set()
    for cls in DOCUMENTED_CLASSES:
        fields = dataclasses.fields(cls)
        if not fields:
            expected.add((cls.__name__, NO_PARAMETER))
            continue
        for field in fields:
            expected.add((cls.__name__, field.name))
            cell = stated.get((cls.__name__, field.name))
            if cell is None:
                continue
            try:
                value = ast.literal_eval(_code(cell))
            except (ValueError, SyntaxError):
                problems.append(f"{cls.__name__}.{field.name}: default {cell!r} is not a Python literal")
                continue
            if type(value) is not type(field.default) or value != field.default:
                problems.append(f"{cls.__name__}.{field.name}: README says {value!r}, "
                                f"the class says {field.default!r}")
    for key in sorted(expected - stated.keys()):
        problems.append(f"{key[0]}.{key[1]} is missing from the table")
    for key in sorted(stated.keys() - expected):
        problems.append(f"{key[0]}.{key[1]} is in the table but not a parameter of that class")
    return problems


def test_readme_states_every_default_as_the_classes_have_it():
    rows = defaults_table(README.read_text())
    assert len(rows) >= len(DOCUMENTED_CLASSES)
    assert table_problems(README.read_text()) == []


def test_the_documented_keras_defaults_hold():
    """The values the README singles out as Keras conventions."""
    from wehub_ps.specs import Adagrad, Adam

    assert Adam().epsilon == 1e-7 and Adagrad().epsilon == 1e-7
    assert Adagrad().initial_accumulator_value == 0.1


def test_the_check_reports_a_drifted_table():
    text = README.read_text()
    row = "| `Adam` | `epsilon` | `1e-7` |"
    assert row in text
    drifted = text.replace(row, "| `Adam` | `epsilon` | `1e-8` |")
    assert table_problems(drifted) == ["Adam.epsilon: README says 1e-08, the class says 1e-07"]
    missing = text.replace("| `Momentum` | `nesterov` | `False` |", "| `Momentum` | `dampening` | `0.0` |")
    assert table_problems(missing) == ["Momentum.nesterov is missing from the table",
                                       "Momentum.dampening is in the table but not a parameter of that class"]
    wrong_type = text.replace("| `Constant` | `value` | `0.0` |", "| `Constant` | `value` | `0` |")
    assert table_problems(wrong_type) == ["Constant.value: README says 0, the class says 0.0"]
