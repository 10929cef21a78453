"""Write the prometheus-operator CRD JSON schemas the deploy tests validate against.

Source: the PyPI package ``cloudcoil-models-prometheus-operator==0.80.1.0`` (Apache-2.0), whose
pydantic models are generated from the ``openAPIV3Schema`` of prometheus-operator v0.80.1's CRDs
(``monitoring.coreos.com/v1``). Run it in a throwaway virtualenv; the output is committed:

    python -m venv /tmp/cc && /tmp/cc/bin/pip install cloudcoil-models-prometheus-operator==0.80.1.0
    /tmp/cc/bin/python deploy/schemas/generate.py

Two edits make the schemas behave like ``kubectl apply`` against the real CRDs:

* every object schema that lists ``properties`` and says nothing about other keys gets
  ``additionalProperties: false`` — the API server's strict field validation (kubectl's default
  ``--validate=strict``) rejects unknown fields of a structural CRD schema;
* ``apiVersion``, ``kind``, ``metadata`` and ``metadata.name`` are required, ``apiVersion`` and
  ``kind`` fixed — what any object sent to the API server has.
"""
from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

PACKAGE = "cloudcoil-models-prometheus-operator"
OUT = Path(__file__).resolve().parent


def _strict(node):
    if isinstance(node, dict):
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for value in node.values():
            _strict(value)
    elif isinstance(node, list):
        for value in node:
            _strict(value)
    return node


def schema(cls, kind: str) -> dict:
    s = _strict(cls.model_json_schema(by_alias=True, mode="validation"))
    s["properties"]["apiVersion"] = {"const": "monitoring.coreos.com/v1", "type": "string"}
    s["properties"]["kind"] = {"const": kind, "type": "string"}
    s["properties"]["metadata"] = {"$ref": "#/$defs/ObjectMeta"}
    s["required"] = ["apiVersion", "kind", "metadata", "spec"]
    s["$defs"]["ObjectMeta"]["required"] = ["name"]
    s["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    s["$comment"] = (f"monitoring.coreos.com/v1 {kind} from {PACKAGE}=={version(PACKAGE)} "
                     "(prometheus-operator v0.80.1 CRDs); made strict by deploy/schemas/generate.py")
    return s


def main() -> None:
    from cloudcoil.models.prometheus_operator import v1

    for cls, name in ((v1.PodMonitor, "podmonitor"), (v1.PrometheusRule, "prometheusrule")):
        path = OUT / f"monitoring.coreos.com_v1_{name}.json"
        path.write_text(json.dumps(schema(cls, cls.__name__), indent=1, sort_keys=True) + "\n")
        print(path)


if __name__ == "__main__":
    main()
