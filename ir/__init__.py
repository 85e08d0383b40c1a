"""Intermediate representation: models split into ONNX stages, stage manifests, executors.

Owns partitioning a model into stages, exporting each stage to ONNX (with KV-cache inputs and
outputs for decoders), stage manifests with content hashes and cost figures, and the executors
(onnxruntime, torch) behind one interface. It never talks to the network.
"""
