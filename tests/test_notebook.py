"""notebooks/explore.ipynb: committed without outputs, and run top to bottom (nbclient, the `python3` kernel of
the running interpreter) without an error, so it cannot rot."""

import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "explore.ipynb"


def test_outputs_are_stripped():
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert code and all(c["outputs"] == [] and c["execution_count"] is None for c in code)
    assert json.loads(NOTEBOOK.read_text())["metadata"]["kernelspec"]["name"] == "python3"


@pytest.mark.slow
def test_runs_top_to_bottom(monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    # the kernel runs this interpreter (ipykernel's own `python3` spec), with the repository on its path
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # jupyter_client starts a kernel spec's `python` as sys.executable: the kernel is this interpreter
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 3  # the layer plots
