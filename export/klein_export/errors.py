"""The errors klein-export reports to its user: the CLI prints them and exits 2."""


class KleinExportError(Exception):
    """Base of every error caused by the input (checkpoint, bundle, options), not by a bug."""


class CheckpointError(KleinExportError):
    """The checkpoint directory is not a usable FLUX.2-klein checkpoint."""


class BundleError(KleinExportError):
    """The bundle directory is not a readable klein bundle."""


class OutputExistsError(KleinExportError, FileExistsError):
    """The output directory exists (bundles are overwritten with `force` only)."""


class BundleExistsError(OutputExistsError):
    """The output bundle exists and `force` was not given."""


class PrecisionError(KleinExportError, ValueError):
    """The requested precision cannot be exported or would not run."""


class QuantizationError(KleinExportError, ValueError):
    """The requested quantization is not one this exporter writes."""


class StaticShapesError(KleinExportError, ValueError):
    """A --static-shapes or --refs value that cannot be exported."""


class LoraError(KleinExportError, ValueError):
    """A LoRA file that cannot be read or does not fit the checkpoint."""


def first_names(names) -> str:
    """The first three of `names`, and how many more: the examples an error message gives."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
