import json
from pathlib import Path

from sfguard.supervisor.daemon.api import openapi_document


def test_docs_openapi_json_is_current():
    """docs/openapi.json is what the daemon serves; regenerate with
    `.venv/bin/python -m sfguard.supervisor.daemon.api > docs/openapi.json`."""
    shipped = json.loads((Path(__file__).resolve().parents[2] / "docs" / "openapi.json").read_text())
    assert shipped == json.loads(json.dumps(openapi_document()))
