"""Per-device hardware numbers for the cost model, with the datasheet each one comes from."""

from __future__ import annotations

import dataclasses

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Hardware:
  """One accelerator (or host): peak numbers per device, before any efficiency factor."""

  name: str
  peak_flops: float  # dense bf16 FLOP/s (no structured sparsity)
  hbm_bandwidth: float  # bytes/s
  hbm_bytes: float  # bytes of device memory
  link_bandwidth: float  # bytes/s one device can receive during a weight transfer (one direction)
  source: str  # where the numbers come from

  def __post_init__(self):
    for name in ("peak_flops", "hbm_bandwidth", "hbm_bytes", "link_bandwidth"):
      if not getattr(self, name) > 0:
        raise ValueError(f"Hardware {self.name!r}: {name} must be > 0 (got {getattr(self, name)})")

  def replace(self, **kw) -> Hardware:
    return dataclasses.replace(self, **kw)


_GCP = "https://cloud.google.com/tpu/docs/"
# Interconnect numbers on the datasheets are bidirectional; a weight transfer is bound by one direction.
PRESETS: dict[str, Hardware] = {
    "tpu_v5e": Hardware(
        "tpu_v5e", 197e12, 819e9, 16 * GiB, 400e9 / 2,
        _GCP + "v5e (197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s, ICI 400 GB/s bidirectional)"),
    "tpu_v5p": Hardware(
        "tpu_v5p", 459e12, 2765e9, 95 * GiB, 1200e9 / 2,
        _GCP + "v5p (459 TFLOP/s bf16, 95 GiB HBM2e at 2,765 GB/s, ICI 1,200 GB/s bidirectional)"),
    "tpu_v6e": Hardware(
        "tpu_v6e", 918e12, 1638e9, 32e9, 800e9 / 2,
        _GCP + "v6e (918 TFLOP/s bf16, 32 GB HBM at 1,638 GB/s, ICI 800 GB/s bidirectional)"),
    "h100": Hardware(
        "h100", 989e12, 3.35e12, 80e9, 900e9 / 2,
        "https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM: 1,979 TFLOP/s bf16 with sparsity, "
        "so 989 dense; 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s bidirectional)"),
    "h200": Hardware(
        "h200", 989e12, 4.8e12, 141e9, 900e9 / 2,
        "https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM: 1,979 TFLOP/s bf16 with sparsity, "
        "so 989 dense; 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s bidirectional)"),
    "h800": Hardware(
        "h800", 989e12, 3.35e12, 80e9, 400e9 / 2,
        "NVIDIA H800 SXM (China export H100: same compute and memory as H100 SXM, 989 TFLOP/s bf16 dense, "
        "80 GB HBM3 at 3.35 TB/s; NVLink cut to 400 GB/s bidirectional)"),
    "h20": Hardware(
        "h20", 148e12, 4.0e12, 96e9, 900e9 / 2,
        "NVIDIA H20 (China export Hopper: 148 TFLOP/s fp16/bf16 dense, 96 GB HBM3 at 4.0 TB/s, NVLink 900 GB/s "
        "bidirectional)"),
    "a100": Hardware(
        "a100", 312e12, 2.039e12, 80e9, 600e9 / 2,
        "https://www.nvidia.com/en-us/data-center/a100/ (A100 80GB SXM: 312 TFLOP/s bf16 dense, 80 GB HBM2e at "
        "2,039 GB/s, NVLink 600 GB/s bidirectional)"),
    "b200": Hardware(
        "b200", 2.25e15, 8.0e12, 180e9, 1800e9 / 2,
        "NVIDIA HGX B200 at 1,000 W (per GPU: 2.25 PFLOP/s bf16 dense, 4.5 with sparsity; 180 GB HBM3e, 8 TB/s "
        "(64 TB/s per 8-GPU board); NVLink 5 1.8 TB/s bidirectional)"),
    "mi300x": Hardware(
        "mi300x", 1307e12, 5.3e12, 192e9, 896e9 / 2,
        "AMD Instinct MI300X (1,307 TFLOP/s bf16 dense, 192 GB HBM3 at 5.3 TB/s, Infinity Fabric 896 GB/s "
        "aggregate bidirectional)"),
    "tpu_v4": Hardware(
        "tpu_v4", 275e12, 1200e9, 32 * GiB, 300e9 / 2,
        _GCP + "v4 (275 TFLOP/s bf16, 32 GiB HBM2 at 1,200 GB/s); ICI per chip taken as 6 links x 50 GB/s "
        "(300 GB/s bidirectional; not on the page: an assumption)"),
    # The development host: 2 AMD EPYC (Zen 1) cores at 2.0 GHz, 2 x 128-bit FMA pipes = 16 fp32 FLOP/cycle
    # per core. Bandwidth is measured (numpy copy of 200 MB: ~20 GB/s), not a datasheet number.
    "cpu": Hardware(
        "cpu", 2 * 2.0e9 * 16, 20e9, 23 * GiB, 10e9,
        "lscpu on the dev host (2 x AMD EPYC Zen 1 @ 2.0 GHz, AVX2 FMA: 16 fp32 FLOP/cycle/core); "
        "bandwidth measured with np.copyto on 200 MB arrays"),
}


def preset(name: str) -> Hardware:
  """The named preset; the error lists the known names."""
  if name not in PRESETS:
    raise ValueError(f"unknown hardware preset {name!r}; known: {sorted(PRESETS)}")
  return PRESETS[name]
