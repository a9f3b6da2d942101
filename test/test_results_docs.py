"""docs/results/README.md shows where the project stands first: the current Tables 1 and 2, each
summarised from its folder's CSV, every number in the summary equal to the CSV's, and links that
resolve."""

import csv
import re
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
# A summary column -> the CSV rows its numbers come from, in the order they are written.
COLUMN_ROWS = {
    "in distribution": ("rural-summer-dry-day-car",),
    "OOD average [95%]": ("average", "average_low", "average_high"),
    "minus DA, points [paired 95%]": ("gain_over_DA_points", "gain_low_points", "gain_high_points"),
    "obstacles passed (OOD)": ("obstacle_pass_rate",),
    "layouts x training seeds": ("layouts", "training_seeds"),
}
NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)?")


def sections(text: str) -> list[tuple[str, list[str]]]:
    """(heading, lines) of each `## ` section."""
    found = []
    for line in text.splitlines():
        if line.startswith("## "):
            found.append((line[3:], []))
        elif found:
            found[-1][1].append(line)
    return found


def table_rows(lines: list[str]) -> list[list[str]]:
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines if line.startswith("|")]
    return [row for row in rows if not set("".join(row)) <= set("-")]


def csv_columns(path: Path) -> dict[str, dict[str, str]]:
    """{method: {row name: value}} of a tables CSV."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return {method: {row["scenario"]: row[method] for row in rows} for method in rows[0] if method != "scenario"}


README = (RESULTS / "README.md").read_text()
TABLES = [(heading, lines) for heading, lines in sections(README) if heading.startswith("Table ")]


def test_the_current_tables_come_first():
    headings = [heading for heading, _ in sections(README)]
    assert headings[:2] == ["Table 1: methods (`driving/table1/`)", "Table 2: selection variants and rates (`driving/table2/`)"]
    for heading, lines in TABLES:
        folder = re.search(r"`(driving/table\d)/`", heading).group(1)
        assert any(f"]({folder}/accuracy_vs_rate.png)" in line for line in lines), f"{heading}: its plot"


@pytest.mark.parametrize("heading, lines", TABLES, ids=[heading.split(":")[0] for heading, _ in TABLES])
def test_every_number_of_a_summary_is_its_csvs(heading, lines):
    folder = re.search(r"`(driving/table(\d))/`", heading)
    columns = csv_columns(RESULTS / folder.group(1) / f"table{folder.group(2)}.csv")
    header, *rows = table_rows(lines)
    assert header[0] == "method" and all(name in COLUMN_ROWS for name in header[1:]), header
    assert [row[0] for row in rows if row[0] in columns] == [row[0] for row in rows]  # every row is a CSV column
    assert set(columns) == {row[0] for row in rows}, "every method of the table has its row"
    for method, *cells in rows:
        for name, cell in zip(header[1:], cells):
            expected = [columns[method][row] for row in COLUMN_ROWS[name]]
            if method == "DA" and name.startswith("minus DA"):
                expected = []  # DA against itself: left blank
            assert NUMBER.findall(cell) == expected, (heading, method, name)


@pytest.mark.parametrize("readme", ["README.md", "archive/README.md"])
def test_links_resolve(readme):
    path = RESULTS / readme
    targets = re.findall(r"\]\(([^)]+)\)", path.read_text())
    assert targets
    missing = [target for target in targets if not (path.parent / target).exists()]
    assert not missing
