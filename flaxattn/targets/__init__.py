"""GpuTargetConfigProto text files of the NVIDIA targets (flaxattn.aot.TARGETS)."""
