"""Documents that agree with the reports (issue 41): the report tables of README.md and docs/RESULTS.md are rendered
from the reports' CSVs by `python -m oscar docs`; the committed documents must equal their render, and
reports/README.md must index every report. CPU only, no model."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from oscar.commands import docs

ROOT = Path(__file__).resolve().parent.parent


def test_committed_documents_equal_their_render():
    """Fails on drift: a report CSV changed and the documents were not re-rendered, or a rendered table was edited
    by hand. Fix: `python -m oscar docs` (then review the diff)."""
    done = subprocess.run([sys.executable, "-m", "oscar", "docs", "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"documents differ from the reports' render:\n{done.stdout[-6000:]}{done.stderr}"


def test_every_document_block_is_known_and_present():
    for doc in docs.DOCUMENTS:
        names = re.findall(r"<!-- render: ([a-z0-9_]+) -->", (ROOT / doc).read_text())
        assert names, f"{doc} holds no rendered block"
        assert set(names) <= set(docs.BLOCKS), f"{doc}: unknown blocks {set(names) - set(docs.BLOCKS)}"
    used = {n for doc in docs.DOCUMENTS for n in re.findall(r"<!-- render: ([a-z0-9_]+) -->", (ROOT / doc).read_text())}
    assert used == set(docs.BLOCKS), f"blocks no document uses: {set(docs.BLOCKS) - used}"


SERVED_CSV = """variant,method,n,pass_at_1,ci_lo,ci_hi,bits_per_element,diff_vs_bf16,diff_ci_lo,diff_ci_hi,pass_served,pass_embedded,verdict_agreement,hardware
bf16,bf16@sglang,4,0.5,0.25,0.75,16,,,,0.5,0.75,0.75,GPU X
kivi2,kivi2@sglang,4,0.25,0,0.5,3.0625,-0.25,-0.5,0,0.25,,,GPU X
"""


def _fixture(tmp_path: Path, csv_text: str, doc: str = "README.md") -> Path:
    (tmp_path / "reports" / "accuracy").mkdir(parents=True)
    (tmp_path / "reports" / "accuracy" / "humaneval_served.csv").write_text(csv_text)
    (tmp_path / doc).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / doc).write_text("intro\n\n<!-- render: humaneval_served -->\nstale\n<!-- /render -->\n\nafter\n")
    return tmp_path


def test_one_block_from_a_tiny_csv(tmp_path):
    root = _fixture(tmp_path, SERVED_CSV)
    old, new = docs.render_file(root, "README.md")
    assert old != new and new.startswith("intro\n\n<!-- render: humaneval_served -->\n") and new.endswith(
        "<!-- /render -->\n\nafter\n")
    lines = new.splitlines()
    assert lines[3] == ("| served cache, windows sink / recent | pass@1 % [95% CI] | vs served BF16, paired (pts) | "
                        "bits / element | served / embedded pass@1 % (same verdict %) |")
    assert lines[5] == "| BF16 (SGLang's own attention) | 50.0 [25.0, 75.0] | (reference) | 16.00 | 50.0 / 75.0 (75.0) |"
    # a zero upper bound prints +0.0, not -0.0; no embedded record: '-'
    assert lines[6] == "| KIVI-2 (its paged twin), 0/64 | 25.0 [0.0, 50.0] | -25.0 [-50.0, +0.0] | 3.06 | - |"
    # no cuda_graph/radix columns: the caption says the cells ran with graphs and radix off
    assert "CUDA graphs off, radix cache off" in new and "GPU X" in new
    assert "[`reports/accuracy/humaneval_served.csv`](reports/accuracy/humaneval_served.csv)" in new
    # rendering is idempotent and deterministic
    (root / "README.md").write_text(new)
    assert docs.render_file(root, "README.md") == (new, new)


def test_served_columns_and_links_relative_to_the_document(tmp_path):
    csv_text = SERVED_CSV.replace("hardware\n", "hardware,cuda_graph,radix\n").replace("GPU X\n", "GPU X,true,true\n")
    root = _fixture(tmp_path, csv_text, doc="docs/RESULTS.md")
    _, new = docs.render_file(root, "docs/RESULTS.md")
    assert "| graphs / radix |" in new and "| on / on |" in new and "radix cache off" not in new
    # a new measurement prints its variants by name, not with the committed cells' labels
    assert "| `bf16` |" in new and "SGLang's own attention" not in new
    assert "(../reports/accuracy/humaneval_served.csv)" in new
    # with the windows and calibration each variant ran with (no windows for bf16, no calibration for kivi2)
    csv_text = (SERVED_CSV.replace("variant,method,", "variant,method,windows,calibration,")
                .replace("bf16,bf16@sglang,", "bf16,bf16@sglang,-,-,").replace("kivi2,kivi2@sglang,", "kivi2,kivi2@sglang,0/64,-,")
                + "auto,auto@sglang,0/64,code,4,0.5,0.25,0.75,6.4,0,-0.25,0.25,,,,GPU X\n")
    csv_text = csv_text.replace("hardware\n", "hardware,cuda_graph,radix\n").replace("GPU X\n", "GPU X,true,true\n")
    (root / "reports" / "accuracy" / "humaneval_served.csv").write_text(csv_text)
    _, new = docs.render_file(root, "docs/RESULTS.md")
    assert "| `bf16` | 50.0" in new and "| `kivi2`, 0/64 | 25.0" in new and "| `auto`, 0/64, code calibration | 50.0" in new


def test_check_mode_prints_a_diff_and_exits_1(tmp_path, capsys):
    root = _fixture(tmp_path, SERVED_CSV)
    assert docs.main(["--check", "--root", str(root), "README.md"]) == 1
    out = capsys.readouterr().out
    assert "-stale" in out and "+| BF16" in out
    assert docs.main(["--root", str(root), "README.md"]) == 0  # writes
    assert docs.main(["--check", "--root", str(root), "README.md"]) == 0


def test_unknown_block_and_unbalanced_markers_are_refused(tmp_path, capsys):
    (tmp_path / "README.md").write_text("<!-- render: nope -->\nx\n<!-- /render -->\n")
    assert docs.main(["--check", "--root", str(tmp_path), "README.md"]) == 1
    assert "unknown block 'nope'" in capsys.readouterr().err
    (tmp_path / "README.md").write_text("<!-- render: table2 -->\nx\n")
    assert docs.main(["--check", "--root", str(tmp_path), "README.md"]) == 1
    assert "markers" in capsys.readouterr().err


def test_formats():
    assert docs.sig(0.013488) == "0.0135" and docs.sig(0.12994) == "0.130" and docs.sig(1.0182) == "1.02"
    assert docs.sig(0.0012) == "0.0012" and docs.sig(0) == "0"
    assert docs.pts(-0.0) == "+0.0" and docs.pts(-0.0004) == "+0.0" and docs.pct(0.8125) == "81.2"


def _index_patterns(text: str) -> list[re.Pattern]:
    """The report paths of reports/README.md's index (first cells of its table, in backquotes), as patterns: `<model>` is any name, `{a,b}` either,
    a folder (`x/`) everything under it."""
    out = []
    index = text.split("## Studies and measurements outside the workflow", 1)[-1]
    first_cells = [line.split("|")[1] for line in index.splitlines() if line.startswith("| `")]
    for token in re.findall(r"`([^`\s]+)`", "\n".join(first_cells)):
        token = token.removeprefix("reports/")
        if not re.fullmatch(r"[\w.<>{},@+/-]+", token) or ("/" not in token and "." not in token):
            continue
        rx = ""
        for part in re.split(r"(<[^>]+>|\{[^}]*\})", token):
            if part.startswith("<"):
                rx += "[^/]+"
            elif part.startswith("{"):
                rx += "(" + "|".join(re.escape(x) for x in part[1:-1].split(",")) + ")"
            else:
                rx += re.escape(part)
        out.append(re.compile(rx + (".*" if token.endswith("/") else "")))
    return out


def test_reports_readme_indexes_every_report():
    """Every markdown report under reports/ is named in reports/README.md, by its path or by a folder above it."""
    readme = ROOT / "reports" / "README.md"
    patterns = _index_patterns(readme.read_text())
    missing = []
    for path in sorted((ROOT / "reports").rglob("*.md")):
        rel = path.relative_to(ROOT / "reports").as_posix()
        if rel == "README.md":
            continue
        if not any(p.fullmatch(rel) for p in patterns):
            missing.append(rel)
    assert missing == [], f"reports/README.md does not index: {missing}"


@pytest.mark.parametrize("doc", ["README.md", "docs/RESULTS.md", "docs/SERVING.md", "docs/KERNELS.md",
                                 "benchmarks/README.md", "reports/README.md"])
def test_documents_name_no_retired_script_as_a_command(doc):
    """A command in a code block names the current entry points, not a script that left the tree."""
    text = (ROOT / doc).read_text()
    blocks = "\n".join(re.findall(r"```[a-z]*\n(.*?)```", text, re.S))
    retired = re.findall(r"benchmarks/(gpu_(?!model_pieces)[a-z0-9_]+\.sh|[a-z_0-9]+\.py)", blocks)
    retired = [r for r in retired if not (ROOT / "benchmarks" / r).exists()]
    assert retired == [], f"{doc}: commands name retired scripts {retired}"
