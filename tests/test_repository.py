"""The repository's own rules: links that resolve, tests that use public names only, the
package's import boundaries and file sizes. The first three have their control: a
planted case that they must catch."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from launch import REPO, readme_commands

DOCUMENTS = [
    REPO / "README.md",
    REPO / "tests" / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
]
#: "About 500 lines" (issue 32): the package, losses/, models/ and trainer.py.
MAX_LINES = 520
#: What models/ and losses/ may import of the package: the collectives, the version
#: shims, ``config``'s ``option`` (a leaf, over ``untrusted``'s parsers), with which a
#: tower declares its own options, and ``untrusted``'s JSON reader (a timm folder's).
ALLOWED_IMPORTS = {"contrastive_accelerate.collectives", "contrastive_accelerate.compat",
                   "contrastive_accelerate.config", "contrastive_accelerate.untrusted"}  # fmt: skip


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(document: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", document.read_text(), flags=re.S | re.M)
    return {github_anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def broken_links(document: Path) -> list[str]:
    """Each relative link of ``document`` whose file or heading does not exist."""
    text = re.sub(r"^```.*?^```", "", document.read_text(), flags=re.S | re.M)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (document.parent / path).resolve() if path else document
        if not linked.exists() or (anchor and anchor not in anchors(linked)):
            broken.append(target)
    return broken


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_relative_link_resolves(document):
    assert broken_links(document) == []


def test_control_a_broken_link_and_a_missing_heading_are_caught(tmp_path):
    (tmp_path / "page.md").write_text("# Page\n\n## A `heading`: here\n")
    document = tmp_path / "index.md"
    document.write_text(
        "[ok](page.md#a-heading-here) [gone](nowhere.md) [no heading](page.md#elsewhere) "
        "[web](https://example.com) [self](#index)\n\n# Index\n"
    )
    assert broken_links(document) == ["nowhere.md", "page.md#elsewhere"]


def private_names(path: Path) -> list[str]:
    """Private names that ``path`` imports, or reads as attributes (``x._name``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            found += [alias.name for alias in node.names if alias.name.startswith("_")]
        elif isinstance(node, ast.Attribute) and re.match(r"_[^_]", node.attr):
            found.append(ast.unparse(node))
    return found


@pytest.mark.parametrize("path", sorted((REPO / "tests").glob("*.py")), ids=lambda p: p.name)
def test_no_test_reaches_into_a_private_name(path):
    assert private_names(path) == []


def test_control_a_private_import_and_attribute_are_caught(tmp_path):
    planted = tmp_path / "test_planted.py"
    planted.write_text("from somewhere import _hidden\nx = state._shared\ny = x.__name__\n")
    assert private_names(planted) == ["_hidden", "state._shared"]


def project_imports(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "contrastive_accelerate":
            modules |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
    return {module for module in modules if module.startswith("contrastive_accelerate")}


@pytest.mark.parametrize("folder", ["models", "losses"])
def test_models_and_losses_import_only_the_collectives_compat_and_config(folder):
    for path in sorted((REPO / folder).glob("*.py")):
        assert project_imports(path) <= ALLOWED_IMPORTS, path.name


def test_control_an_import_of_the_package_beyond_them_is_caught(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from contrastive_accelerate import collectives, ranks\n"
        "import contrastive_accelerate.data.sources\n"
    )
    assert project_imports(planted) - ALLOWED_IMPORTS == {
        "contrastive_accelerate.ranks",
        "contrastive_accelerate.data.sources",
    }


def source_files() -> list[Path]:
    """trainer.py and every module of the package, losses/ and models/."""
    files = [REPO / "trainer.py"]
    for folder in ("contrastive_accelerate", "losses", "models"):
        files += sorted((REPO / folder).rglob("*.py"))
    return files


def parser_calls(path: Path) -> list[str]:
    """The calls in ``path`` that parse a file's JSON or YAML: ``json.load``,
    ``json.loads`` and every ``yaml.*load*``, however the module is named."""
    tree = ast.parse(path.read_text())
    aliases = {alias.asname or alias.name: alias.name for node in ast.walk(tree)
               if isinstance(node, ast.Import) for alias in node.names}  # fmt: skip
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("json", "yaml"):
            found += [f"from {node.module} import {alias.name}" for alias in node.names
                      if "load" in alias.name]  # fmt: skip
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            module = aliases.get(owner.id) if isinstance(owner, ast.Name) else None
            if (module, node.func.attr) in (("json", "load"), ("json", "loads")) or (
                module == "yaml" and "load" in node.func.attr
            ):
                found.append(ast.unparse(node.func))
    return found


def test_every_json_and_yaml_file_is_read_by_the_one_safe_reader():
    """Only ``contrastive_accelerate.untrusted`` parses a file's JSON or YAML, so every
    failure (``RecursionError`` and ``MemoryError`` included) is one line."""
    reader = REPO / "contrastive_accelerate" / "untrusted.py"
    calls = {str(path.relative_to(REPO)): parser_calls(path) for path in source_files()}
    assert calls.pop(str(reader.relative_to(REPO))), "the reader itself calls the parsers"
    assert {name: found for name, found in calls.items() if found} == {}


def test_control_a_parser_call_outside_the_reader_is_caught(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import json\nimport yaml as y\nfrom json import loads\n"
        "json.loads(t)\ny.safe_load(t)\njson.dumps(v)\nother.load(f)\n"
    )
    assert parser_calls(planted) == ["from json import loads", "json.loads", "y.safe_load"]


def test_no_source_file_is_over_about_500_lines():
    files = source_files()
    sizes = {str(path.relative_to(REPO)): len(path.read_text().splitlines()) for path in files}
    print(f"largest: {max(sizes.items(), key=lambda item: item[1])}")
    assert {name: lines for name, lines in sizes.items() if lines > MAX_LINES} == {}


def test_the_wheel_ships_every_package_of_the_project():
    """Every folder with an ``__init__.py`` under the project's top-level packages is in
    what setuptools ships (a listed package ships without its subpackages)."""
    import tomllib
    from setuptools import find_packages

    settings = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    shipped = set(find_packages(str(REPO), **settings["packages"]["find"]))
    on_disk = {
        ".".join(init.parent.relative_to(REPO).parts)
        for top in ("losses", "models", "contrastive_accelerate")
        for init in (REPO / top).rglob("__init__.py")
    }
    assert {"contrastive_accelerate.data", "contrastive_accelerate.methods"} <= on_disk
    assert on_disk <= shipped, sorted(on_disk - shipped)


def test_ci_runs_the_readmes_two_commands_in_order():
    """``.ci/run`` runs the README's first command (its trainer flags may shorten it) and
    then its second, as written: the order a user follows is the order CI checks."""
    first, second = readme_commands()
    lines = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.startswith(("#", "set ", "cd "))]  # fmt: skip
    assert len(lines) == 2, lines
    assert lines[0].startswith(first + " --"), (lines[0], first)
    assert lines[1] == second
