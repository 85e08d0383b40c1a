"""The onnxruntime executor: picks the best execution provider this machine has.

Imports no torch, so providers that only run onnxruntime need not install it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ir.errors import ExecutorError
from ir.executors.base import check_feeds
from ir.manifest import TensorInfo

# Best first. ORT falls back along the list for any node a provider cannot run.
PREFERENCE = (
    "CUDAExecutionProvider",
    "ROCMExecutionProvider",
    "DmlExecutionProvider",
    "CoreMLExecutionProvider",
    "OpenVINOExecutionProvider",
    "CPUExecutionProvider",
)


def available_providers() -> list[str]:
    return list(ort.get_available_providers())


def choose_providers(requested: Sequence[str] | None = None) -> list[str]:
    """The providers to use: `requested` (checked) or the best available, CPU always last."""
    available = set(available_providers())
    if requested:
        unknown = [p for p in requested if p not in available]
        if unknown:
            raise ExecutorError(
                f"execution providers {unknown} are not available here; "
                f"available: {sorted(available)}"
            )
        chosen = list(requested)
    else:
        chosen = [p for p in PREFERENCE if p in available]
    if "CPUExecutionProvider" not in chosen:
        chosen.append("CPUExecutionProvider")
    return chosen


QDQ_ACCURACY = "session.qdq_matmulnbits_accuracy_level"  # 0/1 float, 4 int8 compute


class OrtExecutor:
    """Runs one ONNX stage with onnxruntime. `run` is thread-safe."""

    def __init__(
        self,
        model: onnx.ModelProto | Path | bytes,
        *,
        providers: Sequence[str] | None = None,
        threads: int | None = None,
        inputs: list[TensorInfo] | None = None,
        outputs: list[TensorInfo] | None = None,
        spinning: bool = True,
    ) -> None:
        """`spinning=False`: idle intra-op threads sleep instead of spinning for the next run
        (a process running small stages now and then beside others, such as a client)."""
        from ir.package import tensor_infos

        options = ort.SessionOptions()
        if not spinning:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # quantized weights (DequantizeLinear + MatMul, fused into 4-/8-bit kernels) multiply
        # float activations: the default (level 4) would quantize activations to int8 too
        options.add_session_config_entry(QDQ_ACCURACY, os.environ.get("FUSIONAI_QDQ_ACCURACY", "1"))
        if threads is not None:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        elif "FUSIONAI_THREADS" in os.environ:
            options.intra_op_num_threads = int(os.environ["FUSIONAI_THREADS"])
        if isinstance(model, onnx.ModelProto):
            source: Any = model.SerializeToString()
            proto = model
        elif isinstance(model, bytes):
            source, proto = model, onnx.load_from_string(model)
        else:
            source, proto = str(model), onnx.load(str(model), load_external_data=False)
        chosen = choose_providers(providers)
        try:
            self.session = ort.InferenceSession(source, options, providers=chosen)
        except Exception as exc:
            raise ExecutorError(f"onnxruntime could not load the stage: {exc}") from None
        self.providers = self.session.get_providers()
        self.name = f"onnxruntime:{self.providers[0]}"
        self.inputs = inputs or tensor_infos(proto.graph.input)
        self.outputs = outputs or tensor_infos(proto.graph.output)
        self._output_names = [o.name for o in self.outputs]

    def run(self, feeds: Mapping[str, np.ndarray[Any, Any]]) -> dict[str, np.ndarray[Any, Any]]:
        check_feeds(self.inputs, feeds)
        try:
            results = self.session.run(self._output_names, dict(feeds))
        except Exception as exc:
            raise ExecutorError(f"onnxruntime failed: {exc}") from None
        return dict(zip(self._output_names, results, strict=True))
