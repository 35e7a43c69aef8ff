"""The documentation a newcomer reads: the results index is complete and current, the README is a short
product page, no page cites the design notes or an issue number, and every relative link resolves.
Fast: no models, no network."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
DOCS = ROOT / "docs"
NOTEBOOK = DOCS / "notebook.md"

# "issue 11", "issues 3", "issue #4", "Issue-12" (not "issues" alone, nor "tissue 3")
ISSUE_NUMBER = re.compile(r"\bissues?[\s-]*#?\d+\b", re.IGNORECASE)
DESIGN = re.compile(r"DESIGN\.md")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".txt", ".toml", ".cfg", ".ini", ".yaml", ".yml", ".rst"}
SKIP_PARTS = {"__pycache__", ".venv", "node_modules"}
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _results_index():
    spec = importlib.util.spec_from_file_location("results_index", ROOT / "scripts" / "results_index.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _text_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        return []
    return sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.suffix in TEXT_SUFFIXES
        and not SKIP_PARTS & set(p.parts)
        and not any(part.endswith(".egg-info") for part in p.parts)
    )


def _citations(paths: list[Path]) -> list[str]:
    """file:line: text for every line that cites DESIGN.md or an issue number."""
    found = []
    for path in paths:
        if path.resolve() == NOTEBOOK.resolve():
            continue
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        for i, line in enumerate(lines, 1):
            if DESIGN.search(line) or ISSUE_NUMBER.search(line):
                found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:120]}")
    return found


# (a) the results index ------------------------------------------------------------------------------


def test_every_results_file_and_plot_is_listed_in_the_index():
    index = (RESULTS / "INDEX.md").read_text()
    files = sorted([*RESULTS.glob("*.json"), *RESULTS.glob("*.png")])
    assert files, "benchmarks/results holds no results files"
    missing = [p.name for p in files if f"]({p.name})" not in index]
    assert not missing, f"not in benchmarks/results/INDEX.md (run `python scripts/results_index.py`): {missing}"


def test_the_results_index_is_up_to_date():
    found = _results_index().problems(RESULTS)
    assert not found, "\n".join(found)


def test_the_index_lists_a_plot_without_a_results_file_on_its_own_row(tmp_path):
    (tmp_path / "a.json").write_text(
        '{"command": "ctxrelay bench a", "machine": {"cpu_model": "X", "cores": 2},'
        ' "rows": [], "written": "2026-12-07T10:00:00+0000"}'
    )
    (tmp_path / "a.png").write_bytes(b"")
    (tmp_path / "b.png").write_bytes(b"")
    (tmp_path / "SUPERSEDES.md").write_text("## What supersedes what\n\n- `a.json` supersedes `gone.json`: why.\n")
    mod = _results_index()
    rows = mod.rows(tmp_path)
    assert rows[0][:4] == ["[a.json](a.json)", "[a.png](a.png)", "2026-12-07T10:00:00+0000", "X, 2 cores"]
    assert rows[1][0] == "[b.png](b.png)" and rows[1][2] == "unknown"
    assert mod.main(["--results", str(tmp_path)]) == 0
    assert "## What supersedes what" in (tmp_path / "INDEX.md").read_text()
    found = mod.problems(tmp_path)
    assert found == ["SUPERSEDES.md:3 names gone.json, which is not in " + str(tmp_path)]
    (tmp_path / "c.json").write_text('{"command": "x", "machine": {}, "rows": []}')
    assert any("c.json is not listed" in p for p in mod.problems(tmp_path))
    assert mod.main(["--results", str(tmp_path), "--check"]) == 1


def test_writing_a_result_keeps_the_folders_index_current(tmp_path, monkeypatch):
    # real tests record checks into benchmarks/results during the suite; the index test runs after them
    from ctxrelay.results import write_results

    monkeypatch.setenv("CTXRELAY_RESULTS_DIR", str(tmp_path))
    mod = _results_index()
    (tmp_path / "INDEX.md").write_text(mod.render(tmp_path))
    write_results("x-checks", [{"transport": "native", "check": "a", "passed": True}], "pytest tests/x.py")
    assert mod.problems(tmp_path) == []
    assert "[x-checks.json](x-checks.json)" in (tmp_path / "INDEX.md").read_text()
    write_results("y-checks", [{"transport": "native", "check": "b", "passed": True}], "pytest tests/y.py")
    assert mod.problems(tmp_path) == []


# (b) the README ---------------------------------------------------------------------------------------


def test_readme_is_a_short_product_page():
    data = README.read_bytes()
    assert len(data) <= 12 * 1024, f"README.md is {len(data)} bytes; the bar is 12288"
    head = data.decode("utf-8").splitlines()[:40]
    text = "\n".join(head)
    assert "make demo" in text and "make test" in text, "the two make commands belong in the README's first 40 lines"
    table = [i for i, line in enumerate(head) if line.startswith("|") and re.match(r"^\|(\s*:?-+:?\s*\|)+$", line)]
    assert table, "the headline table belongs in the README's first 40 lines"


# (c) no design-note or issue citations outside the notebook -------------------------------------------


def _scanned(*names: str) -> list[Path]:
    return [p for name in names for p in _text_files(ROOT / name)]


def test_issue_pattern_matches_what_it_should():
    hits = ["issue 11's bar", "Issue #4", "issues 3 and 4", "(issue 13)", "issue-12"]
    misses = ["issues with the store", "tissue 3", "an issue: 4 of 8", "#4 in the list"]
    assert all(ISSUE_NUMBER.search(h) for h in hits)
    assert not any(ISSUE_NUMBER.search(m) for m in misses)


@pytest.mark.parametrize("where", ["README.md", "docs", "scripts/results_index.py"])
def test_docs_cite_no_design_notes_or_issue_numbers(where):
    found = _citations(_scanned(where))
    assert not found, "cite the command and results file instead:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "where", ["ARCHITECTURE.md", "scripts", "experiments", "src", "benchmarks/ctxrelay_bench", "Makefile"]
)
def test_code_and_architecture_cite_no_design_notes_or_issue_numbers(where):
    found = _citations(_scanned(where))
    assert not found, "cite the command and results file instead:\n" + "\n".join(found)


# (d) relative links -----------------------------------------------------------------------------------


def _links(path: Path) -> list[tuple[int, str]]:
    out, fenced = [], False
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out += [(i, m.group(1)) for m in LINK.finditer(re.sub(r"`[^`]*`", "", line))]
    return out


def test_every_relative_link_in_the_readme_and_docs_resolves():
    broken = []
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        for i, target in _links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL, mailto:, or an anchor in the same page
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}:{i}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_every_results_file_validates():
    """Each results file has the command that wrote it, the machine it ran on, and rows the schema accepts."""
    from ctxrelay.results import validate_rows

    files = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    assert files
    for f in files:
        doc = json.loads(f.read_text())
        assert isinstance(doc.get("command"), str) and doc["command"], f"{f.name}: no command"
        assert isinstance(doc.get("machine"), dict), f"{f.name}: no machine facts"
        validate_rows(doc["rows"])
