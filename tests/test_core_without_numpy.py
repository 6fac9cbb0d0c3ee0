"""numpy is no core dependency (torch does not require it either): the library runs without it.

Its last uses were ``tensor.numpy().tobytes()`` (a checkpoint's JSON-encoded tensors, the
pipeline ties' digests); a new one would break ``pip install flatshard`` on a host without
numpy, which this development venv (numpy comes with transformers) would never notice.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys
sys.modules["numpy"] = None  # import numpy raises ImportError, as on a host without it
import torch, torch.distributed as dist
from torch import nn
import flatshard as fs
from flatshard.checkpoint import jsonable
from flatshard.parallel.pipeline_tied import _digest

for t in [torch.arange(5.0), torch.tensor(True), torch.empty(0), torch.ones(2, 3).bfloat16()]:
    back = jsonable.decode(jsonable.encode(t, "t"))
    assert torch.equal(back, t) and back.dtype == t.dtype, (t, back)
assert _digest(torch.arange(4.0)) == _digest(torch.arange(4.0)) != _digest(torch.ones(4))
dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
model = fs.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), policy=fs.wrap.by_type(nn.Linear))
model(torch.randn(3, 4)).sum().backward()
torch.optim.AdamW(model.parameters()).step()
fs.export_safetensors(model, "{out}")
fs.load("{out}", model=model)
from flatshard.comm.shutdown import end_process_group
end_process_group()
print("ok")
"""


def test_the_core_runs_without_numpy(tmp_path):
    code = SCRIPT.format(store=tmp_path / "store", out=tmp_path / "m.safetensors")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_numpy_is_not_a_core_requirement():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("numpy")]
