"""The ONNX export's parity gate as the report shows it: torchloom.json's "onnx" (model/onnx.py), flat."""

from __future__ import annotations


def onnx_gate(model_dir) -> dict | None:
    """The ONNX export's parity gate (torchloom.json "onnx"), flat for the report; None without one."""
    from torchloom.model.export import read_export_info

    info = read_export_info(model_dir).get("onnx")
    if not info:
        return None
    gate = info.get("gate", {})
    fused = info.get("fused")
    if isinstance(fused, dict):
        from torchloom.model.onnx import fused_ops

        fused = fused_ops(fused) or "none"
    flat = {"format": info.get("format"), "file": info.get("file"), "exporter": info.get("exporter"),
            "fused ops": fused, "gate split": gate.get("split"),
            "gate rows": gate.get("rows"), "PyTorch accuracy": gate.get("torch_accuracy")}
    for kind in ("fp32", "int8"):
        for key, value in (gate.get(kind) or {}).items():
            flat[f"{kind} {key.replace('_', ' ')}"] = value
    return flat
