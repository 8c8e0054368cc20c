"""klein-export: turn a diffusers FLUX.2-klein checkpoint into a klein ONNX bundle."""

__version__ = "0.1.0"

FORMAT_VERSION = 1
"""Version of the bundle format (onnx/README.md) this exporter writes."""
