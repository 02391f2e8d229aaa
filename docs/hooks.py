"""MkDocs hooks: the README is the site's front page, and every benchmark's result file is a page.

* The README links the pages as GitHub shows them (``docs/install.md``); on the site the front page sits
  in ``docs/`` itself, where the same links would point to ``docs/docs/``, which a strict build refuses.
  So ``index.md`` is the README with its ``docs/`` links made relative.
* Each ``benchmarks/results/NAME.md`` becomes the page ``benchmarks/NAME.md``, listed under
  *Measured results* in the nav: a results file a benchmark writes is on the site without a stub.
  A page in ``docs/`` links a results file as GitHub shows it (``../benchmarks/results/NAME.md``); on the
  site that link is made the page's (``benchmarks/NAME.md``), as a strict build refuses a link out of ``docs/``.
"""
from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

RESULTS_SECTION = "Measured results"


def _root(config) -> Path:
    return Path(config["config_file_path"]).parent


def _results(config) -> list:
    return sorted((_root(config) / "benchmarks" / "results").glob("*.md"))


def on_config(config):
    """Append one nav entry per benchmark result file to the *Measured results* section."""
    section = next((entry[RESULTS_SECTION] for entry in config["nav"] if RESULTS_SECTION in entry), None)
    if section is None:
        raise ValueError(f"mkdocs.yml: the nav has no {RESULTS_SECTION!r} section for the benchmark pages")
    section.extend({f"benchmarks/results/{path.name}": f"benchmarks/{path.name}"} for path in _results(config))
    return config


def on_files(files, config):
    """Add the benchmark result files as the pages ``benchmarks/NAME.md``."""
    for path in _results(config):
        files.append(File.generated(config, f"benchmarks/{path.name}", abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Return the README, its ``docs/`` links made relative, as the markdown of ``index.md``; in the other pages
    of ``docs/``, make their links to ``../benchmarks/results/NAME.md`` the site's ``benchmarks/NAME.md``."""
    if page.file.src_uri == "index.md":
        return (_root(config) / "README.md").read_text(encoding="utf-8").replace("](docs/", "](")
    if "/" in page.file.src_uri:  # the benchmark pages themselves
        return markdown
    return markdown.replace("](../benchmarks/results/", "](benchmarks/")
