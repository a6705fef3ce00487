"""A non-editable install ships every package: pyproject's package list and package-dir name
each folder of plugin/, streaming/ and native/ that holds an __init__.py. (The editable install
finds an unlisted folder anyway, so only a built wheel would miss it.)"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    text = (ROOT / "pyproject.toml").read_text()
    start = text.index("packages = [")
    listed = set(re.findall(r'"(expert_stream[\w.]*)"', text[start:text.index("]", start)]))
    mapped = dict(re.findall(r'^"(expert_stream[\w.]*)" = "([\w/]+)"$', text, re.M))
    folders = {f"expert_stream.{init.parent.relative_to(ROOT).as_posix().replace('/', '.')}": init.parent
               for top in ("plugin", "streaming", "native") for init in (ROOT / top).rglob("__init__.py")}
    folders = {("expert_stream" if name == "expert_stream.plugin.package_root" else name): path
               for name, path in folders.items()}
    assert set(folders) <= listed, sorted(set(folders) - listed)
    assert {name: ROOT / mapped.get(name, "") for name in folders} == folders


def test_every_file_a_package_reads_is_package_data():
    """Files the code opens from its own package folders (importlib.resources: the status page)
    ship in a wheel only when package-data names them."""
    text = (ROOT / "pyproject.toml").read_text()
    start = text.index("[tool.setuptools.package-data]")
    listed = {(package, name) for package, names in
              re.findall(r'^"(expert_stream[\w.]*)" = \[(.*)\]$', text[start:text.index("\n\n", start)], re.M)
              for name in re.findall(r'"([^"]+)"', names)}
    folders = {ROOT / path: name for name, path in re.findall(r'^"(expert_stream[\w.]*)" = "([\w/]+)"$', text, re.M)}
    shipped = {(folders[page.parent], page.name) for page in (ROOT / "plugin").rglob("*.html")}
    assert shipped and shipped <= listed, sorted(shipped - listed)
