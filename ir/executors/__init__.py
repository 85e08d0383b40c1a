"""Executors run one ONNX stage behind one interface: numpy arrays in, numpy arrays out.

`OrtExecutor` (onnxruntime) needs no torch; `TorchExecutor` (in `ir.executors.torch_exec`,
imported only when asked for) runs the same graph as a torch module, with autograd.
"""

from ir.executors.base import Executor, check_feeds
from ir.executors.ort import OrtExecutor, available_providers, choose_providers

__all__ = ["Executor", "OrtExecutor", "available_providers", "check_feeds", "choose_providers"]
