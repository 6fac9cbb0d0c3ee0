"""``import flatshard`` and ``fs.shard`` pull in none of the tools' heavy dependencies."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HEAVY = ("matplotlib", "tqdm", "rich", "tensorboard", "transformers", "lightning")

SCRIPT = """
import json, sys
import torch, torch.distributed as dist
before = set(sys.modules)  # torch itself may import some (torch.hub imports tqdm if present)
import flatshard as fs
from torch import nn
dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
model = fs.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), policy=fs.wrap.by_type(nn.Linear))
model(torch.randn(3, 4)).sum().backward()
torch.optim.AdamW(model.parameters()).step()
print(json.dumps(sorted(set(sys.modules) - before)), flush=True)
from flatshard.comm.shutdown import end_process_group  # after the count: Gloo's exit abort
end_process_group()
"""


def test_import_and_shard_do_not_import_heavy_dependencies(tmp_path):
    code = SCRIPT.format(store=Path(tmp_path) / "store")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    new = json.loads(done.stdout.strip().splitlines()[-1])
    heavy = [m for m in new if m.split(".")[0] in HEAVY]
    assert heavy == [], f"import flatshard / fs.shard imported {heavy}"


def test_heavy_dependencies_are_extras_not_core_requirements():
    """A core install (``pip install flatshard``) does not even have them: torch imports tqdm
    at its own import time when it is installed (torch.hub), so the extra is what keeps it out."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: the tomli backport, a dependency there
        import tomli as tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    core = [d.split(";")[0].split(">")[0].split("=")[0].strip() for d in project["dependencies"]]
    assert not set(core) & set(HEAVY), core
    assert {"tqdm", "matplotlib"} <= set(project["optional-dependencies"]["train"])


def test_a_bare_import_of_flatshard_imports_no_heavy_dependency_at_all():
    """Counted from an empty interpreter, not after torch: torch imports tqdm itself when it is
    installed, so ``import flatshard`` must not import torch either (names load on first use)."""
    code = "import sys, json; import flatshard; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = {m.split(".")[0] for m in json.loads(done.stdout.strip().splitlines()[-1])}
    assert not loaded & {*HEAVY, "torch"}, sorted(loaded & {*HEAVY, "torch"})


def test_every_public_name_loads_lazily():
    import flatshard as fs

    lazy = set(fs._WHERE) | set(fs._SUBPACKAGES)
    assert set(fs.__all__) == lazy, set(fs.__all__) ^ lazy
    for name in fs.__all__:
        assert getattr(fs, name) is not None, name


def test_the_package_has_no_import_circle():
    from import_graph import circles, import_edges, module_files

    edges = import_edges(module_files())
    assert sum(map(len, edges.values())) > 300, "the graph reader found too few imports"
    assert circles(edges) == [], "import circles (one module must stop importing the other)"


def test_the_circle_finder_finds_a_circle():
    from import_graph import circles

    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(edges) == [["a", "b", "c"]]
